//! Serving one completion request: parse, apply faults, wait for a sequence slot, then follow
//! the latency model while answering in one piece or as a stream.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::{sleep, sleep_until, Instant};

use crate::answers;
use crate::api::{
    json_response, ApiError, CompletionRequest, Endpoint, ResponseMeta, Usage, DONE_EVENT,
};
use crate::body::{BodyError, SimBody, StreamItem};
use crate::faults::FaultPlan;
use crate::generate::Generation;
use crate::routes::read_body;
use crate::state::{unix_now, CancelGuard, SimState};
use crate::tier_eval::TaskClass;

/// Events buffered between the producer and the connection. Small, so a slow client holds up
/// generation (as it would hold vLLM's output queue) instead of piling up memory.
const STREAM_BUFFER: usize = 4;

/// Mixed into the seed of a vocabulary answer chosen to be wrong.
const WRONG_SEED: u64 = 0x0057_524f_4e47;

/// The connection is aborted without a response, as an injected fault demands.
#[derive(Debug, thiserror::Error)]
#[error("connection aborted by an injected fault")]
pub(crate) struct InjectedAbort;

/// A validated request and the answer planned for it.
#[derive(Debug)]
struct Job {
    endpoint: Endpoint,
    request: CompletionRequest,
    generation: Generation,
    reset_after_chunks: Option<u64>,
    arrived: Instant,
}

/// How a stream ended early.
#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    #[error("client went away")]
    ClientGone,
    #[error("reset by an injected fault")]
    Reset,
    #[error(transparent)]
    Admission(#[from] crate::state::AdmissionClosed),
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
}

/// Sends stream events, counting them so `reset_after_chunks` can cut in.
struct EventSink {
    tx: mpsc::Sender<StreamItem>,
    sent: u64,
    reset_after: Option<u64>,
    paced: bool,
}

/// Serves `POST /v1/chat/completions` and `POST /v1/completions`.
pub(crate) async fn serve(
    state: Arc<SimState>,
    endpoint: Endpoint,
    body: Incoming,
) -> Result<Response<SimBody>, InjectedAbort> {
    let arrived = Instant::now();
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    // Armed from the start so a client leaving during a delay, a hang or the queue counts.
    let guard = CancelGuard::new(&state);
    let job = match prepare(&state, endpoint, body, arrived).await {
        Ok(job) => job,
        Err(error) => {
            guard.disarm();
            return Ok(error.into_response());
        }
    };
    if job.request.stream {
        let (tx, mut rx) = mpsc::channel(STREAM_BUFFER);
        let head_early = state.config.metrics_flavor.head_before_prefill();
        tokio::spawn(produce_stream(state, job, guard, tx));
        // vLLM's head leaves with the first event (after the queue and the time to first
        // token); llama.cpp's as soon as the request is accepted.
        let first = match head_early {
            true => None,
            false => match rx.recv().await {
                // A reset before the first event: no response at all, as for a whole answer.
                Some(Err(_)) => return Err(InjectedAbort),
                first => Some(first),
            },
        };
        let mut response = Response::new(SimBody::channel(first, rx));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        Ok(response)
    } else {
        answer_whole(&state, job, guard).await
    }
}

/// Reads and validates the request and applies the faults that act before any response.
async fn prepare(
    state: &Arc<SimState>,
    endpoint: Endpoint,
    body: Incoming,
    arrived: Instant,
) -> Result<Job, ApiError> {
    let body = read_body(body).await?;
    let request = CompletionRequest::parse(endpoint, &body)?;
    if let Some(model) = request.model.as_deref() {
        if model != state.config.model {
            return Err(ApiError::ModelNotFound(model.to_owned()));
        }
    }
    let plan = state.faults.plan().unwrap_or_default();
    let known = answers::lookup(request.user_text.as_deref());
    let class = known.map_or(TaskClass::General, |k| k.class());
    let (hash, seed) = (request.digest.hash(), state.config.seed);
    let wrong = answers::answers_wrong(hash, seed, plan.wrong_rate.of(class));
    if plan.acts() || wrong {
        state
            .metrics
            .faults_injected
            .fetch_add(1, Ordering::Relaxed);
    }
    if plan.acts() {
        apply_early_faults(&plan).await?;
    }
    let generation = match known {
        Some(known) if !plan.degenerate => {
            Generation::fixed(known.answer(wrong, hash, seed), request.max_tokens)
        }
        _ => Generation::plan(
            &request.digest,
            // Another seed: other words than a right answer (and than a same-seed tier).
            if wrong { seed ^ WRONG_SEED } else { seed },
            request.max_tokens,
            request.ignore_eos,
            plan.degenerate,
        ),
    };
    Ok(Job {
        endpoint,
        request,
        generation,
        reset_after_chunks: plan.reset_after_chunks,
        arrived,
    })
}

/// Delay, hang and injected errors: the faults that act before the response headers.
async fn apply_early_faults(plan: &FaultPlan) -> Result<(), ApiError> {
    if !plan.delay.is_zero() {
        sleep(plan.delay).await;
    }
    if plan.hang {
        // Never answers; the connection task drops this future when the client leaves.
        std::future::pending::<()>().await;
    }
    match plan.error {
        Some(error) => Err(ApiError::Injected {
            status: error.status,
            retry_after_s: error.retry_after_s,
        }),
        None => Ok(()),
    }
}

/// Answers a non-streamed request after the whole generation time.
async fn answer_whole(
    state: &Arc<SimState>,
    job: Job,
    guard: CancelGuard,
) -> Result<Response<SimBody>, InjectedAbort> {
    let Ok(_admitted) = state.admit().await else {
        guard.disarm();
        return Ok(ApiError::Internal("admission queue closed".to_owned()).into_response());
    };
    let prompt_tokens = job.request.digest.prompt_tokens();
    let tokens = job.generation.tokens();
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_tokens, Ordering::Relaxed);
    let prefill = state.start_prefill(
        &job.request.cache_text,
        prompt_tokens,
        u64::from(tokens),
        Instant::now(),
    );
    if state.paced() {
        let started = prefill.done_at;
        sleep_until(started).await;
        state.finish_prefill(&prefill);
        let (ttft, itl) = (state.config.ttft, state.config.itl);
        sleep_until(started + ttft + itl).await;
        state.metrics.ttft.observe(job.arrived.elapsed());
        sleep_until(started + ttft + itl.saturating_mul(tokens)).await;
    } else {
        state.finish_prefill(&prefill);
        state.metrics.ttft.observe(job.arrived.elapsed());
    }
    if job.reset_after_chunks.is_some() {
        guard.disarm();
        return Err(InjectedAbort);
    }
    let id = state.next_id(job.endpoint);
    let meta = ResponseMeta {
        endpoint: job.endpoint,
        id: &id,
        created: unix_now(),
        model: &state.config.model,
    };
    let usage = Usage::new(prompt_tokens, u64::from(tokens));
    let body = meta.completion_body(
        &job.generation.text(),
        job.generation.finish_reason(),
        usage,
    );
    state
        .metrics
        .generation_tokens
        .fetch_add(u64::from(tokens), Ordering::Relaxed);
    state.metrics.e2e.observe(job.arrived.elapsed());
    guard.disarm();
    Ok(match body {
        Ok(body) => json_response(body),
        Err(error) => ApiError::Internal(error.to_string()).into_response(),
    })
}

/// Runs a stream to its end, then settles the cancel guard: only a client that went away
/// counts as cancelled.
async fn produce_stream(
    state: Arc<SimState>,
    job: Job,
    guard: CancelGuard,
    tx: mpsc::Sender<StreamItem>,
) {
    let mut sink = EventSink {
        tx,
        sent: 0,
        reset_after: job.reset_after_chunks,
        paced: state.paced(),
    };
    match stream_events(&state, &job, &mut sink).await {
        Ok(()) | Err(StreamEnd::Reset) => guard.disarm(),
        Err(StreamEnd::ClientGone) => drop(guard),
        Err(error @ (StreamEnd::Admission(_) | StreamEnd::Encode(_))) => {
            tracing::warn!(%error, "stream failed");
            // Ending the body with an error tells the client the stream is incomplete.
            let _ = sink.tx.send(Err(BodyError::InjectedReset)).await;
            guard.disarm();
        }
    }
}

/// Sends a stream in vLLM's event order: role, one event per token, finish, optional usage,
/// `[DONE]`.
async fn stream_events(
    state: &Arc<SimState>,
    job: &Job,
    sink: &mut EventSink,
) -> Result<(), StreamEnd> {
    let _admitted = tokio::select! {
        admitted = state.admit() => admitted?,
        () = sink.tx.closed() => return Err(StreamEnd::ClientGone),
    };
    let prompt_tokens = job.request.digest.prompt_tokens();
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_tokens, Ordering::Relaxed);
    let prefill = state.start_prefill(
        &job.request.cache_text,
        prompt_tokens,
        u64::from(job.generation.tokens()),
        Instant::now(),
    );
    let started = prefill.done_at;
    sink.pace(started).await?;
    state.finish_prefill(&prefill);
    let (ttft, itl) = (state.config.ttft, state.config.itl);
    let id = state.next_id(job.endpoint);
    let meta = ResponseMeta {
        endpoint: job.endpoint,
        id: &id,
        created: unix_now(),
        model: &state.config.model,
    };
    sink.pace(started + ttft).await?;
    if let Some(event) = meta.role_event() {
        sink.send(event?).await?;
    }
    let mut piece = String::with_capacity(16);
    let mut deadline = started + ttft;
    for (i, token) in job.generation.words().enumerate() {
        deadline += itl;
        sink.pace(deadline).await?;
        piece.clear();
        piece.push_str(token.sep);
        piece.push_str(token.word);
        sink.send(meta.token_event(&piece)?).await?;
        state
            .metrics
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
        if i == 0 {
            state.metrics.ttft.observe(job.arrived.elapsed());
        }
    }
    sink.send(meta.finish_event(job.generation.finish_reason())?)
        .await?;
    if job.request.include_usage {
        let usage = Usage::new(prompt_tokens, u64::from(job.generation.tokens()));
        sink.send(meta.usage_event(usage)?).await?;
    }
    sink.send(Bytes::from_static(DONE_EVENT)).await?;
    state.metrics.e2e.observe(job.arrived.elapsed());
    Ok(())
}

// === impl EventSink ===

impl EventSink {
    async fn send(&mut self, event: Bytes) -> Result<(), StreamEnd> {
        if self.reset_after == Some(self.sent) {
            // If the client is already gone the reset has nobody to reach; it is still the
            // server's doing, so the result is the same.
            let _ = self.tx.send(Err(BodyError::InjectedReset)).await;
            return Err(StreamEnd::Reset);
        }
        self.tx
            .send(Ok(event))
            .await
            .map_err(|_| StreamEnd::ClientGone)?;
        self.sent += 1;
        Ok(())
    }

    /// Waits until `deadline`, noticing a client that leaves meanwhile.
    async fn pace(&self, deadline: Instant) -> Result<(), StreamEnd> {
        if !self.paced {
            return Ok(());
        }
        tokio::select! {
            () = sleep_until(deadline) => Ok(()),
            () = self.tx.closed() => Err(StreamEnd::ClientGone),
        }
    }
}
