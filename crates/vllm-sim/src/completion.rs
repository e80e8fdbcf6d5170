//! Serving one completion request: parse, apply faults, wait for a sequence slot, then follow
//! the latency model while answering in one piece or as a stream.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response};
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tokio::time::{sleep, sleep_until, Instant};

use crate::agent_api::{AgentStream, TOOL_ARGUMENTS};
use crate::answers;
use crate::api::{
    json_response, ApiError, CompletionRequest, Endpoint, ResponseMeta, Usage, DONE_EVENT,
};
use crate::body::{BodyError, SimBody, StreamItem};
use crate::faults::{FaultPlan, StreamBreak};
use crate::generate::{FinishReason, Generation};
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
    stream_break: StreamBreak,
    arrived: Instant,
}

/// How a stream ended early.
#[derive(Debug, thiserror::Error)]
enum StreamEnd {
    #[error("client went away")]
    ClientGone,
    #[error("broken by an injected fault")]
    Injected,
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
    how: StreamBreak,
    paced: bool,
}

/// vLLM's event for an error in the middle of a stream.
const ERROR_EVENT: &[u8] = b"data: {\"error\": {\"object\": \"error\", \"message\": \"Simulated engine failure injected by vllm-sim.\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n";

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
    state.record_request(&body);
    let request = CompletionRequest::parse(endpoint, &body)?;
    if let Some(model) = request.model.as_deref() {
        if model != state.config.model {
            return Err(ApiError::ModelNotFound(model.to_owned()));
        }
    }
    if let Some(previous) = request.previous_response_id.as_deref() {
        if !state.has_response(previous) {
            return Err(ApiError::BadRequest(format!(
                "Previous response with id '{previous}' not found."
            )));
        }
    }
    let plan = state.faults.plan().unwrap_or_default();
    let known = answers::lookup(request.user_text.as_deref());
    let class = known.map_or(TaskClass::General, |k| k.class());
    let (hash, seed) = (request.digest.hash(), state.config.seed);
    // A word problem under `wrong_when`: its numbers decide, not a draw; a request without
    // numbers, its listed items when the rule counts them.
    let text = request.user_text.as_deref().unwrap_or_default();
    let numbers = match (known, plan.wrong_when) {
        (None, Some(_)) => answers::quantities(text),
        _ => Vec::new(),
    };
    let rated = answers::is_rating(&request.cache_text);
    let by_rule = !numbers.is_empty() && !rated;
    let by_items = match (known, plan.wrong_when) {
        (None, Some(rule)) if numbers.is_empty() && !rated && rule.items_over.is_some() => {
            Some(rule.wrong_items(answers::list_items(text)))
        }
        _ => None,
    };
    let wrong = match (by_rule, by_items) {
        (true, _) => plan
            .wrong_when
            .is_some_and(|rule| rule.wrong(numbers.len())),
        (false, Some(wrong)) => wrong,
        (false, None) => answers::answers_wrong(hash, seed, plan.wrong_rate.of(class)),
    };
    if plan.acts() || wrong {
        state
            .metrics
            .faults_injected
            .fetch_add(1, Ordering::Relaxed);
    }
    if plan.acts() {
        apply_early_faults(&plan).await?;
    }
    // A continued message's words are part of the answer planned: the cap counts them too.
    let max_tokens = request
        .max_tokens
        .map(|cap| cap.saturating_add(u64::from(request.continued)));
    let generation = match known {
        _ if rated => {
            let digit = answers::rating(text, plan.wrong_when);
            Generation::fixed(digit.to_string(), max_tokens)
        }
        _ if by_rule && !plan.degenerate => Generation::fixed(
            answers::word_problem_answer(&numbers, wrong, answers::shape(hash, seed)),
            max_tokens,
        ),
        Some(known) if !plan.degenerate => {
            Generation::fixed(known.answer(wrong, hash, seed), max_tokens)
        }
        _ => Generation::plan(
            &request.digest,
            // Another seed: other words than a right answer (and than a same-seed tier).
            if wrong { seed ^ WRONG_SEED } else { seed },
            max_tokens,
            request.ignore_eos,
            plan.degenerate,
        ),
    }
    .after(request.continued);
    Ok(Job {
        endpoint,
        request,
        generation,
        reset_after_chunks: plan.reset_after_chunks,
        stream_break: plan.stream_break,
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
    let tokens = job.tokens();
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_tokens, Ordering::Relaxed);
    let prefill = state.start_prefill(
        &job.request,
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
    let meta = job.meta(&id, &state.config.model);
    let usage = Usage::new(prompt_tokens, u64::from(tokens));
    let text = match meta.tool {
        Some(_) => String::new(),
        None => job.generation.text(),
    };
    let body = meta.completion_body(&text, job.finish_reason(), usage);
    if let (Endpoint::Responses, Ok(body)) = (job.endpoint, &body) {
        state.store_response(&id, Bytes::from(body.clone()));
    }
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
        how: job.stream_break,
        paced: state.paced(),
    };
    match stream_events(&state, &job, &mut sink).await {
        Ok(()) | Err(StreamEnd::Injected) => guard.disarm(),
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
        &job.request,
        prompt_tokens,
        u64::from(job.generation.tokens()),
        Instant::now(),
    );
    let started = prefill.done_at;
    sink.pace(started).await?;
    state.finish_prefill(&prefill);
    let (ttft, itl) = (state.config.ttft, state.config.itl);
    let id = state.next_id(job.endpoint);
    let meta = job.meta(&id, &state.config.model);
    let agent_api = matches!(job.endpoint, Endpoint::Messages | Endpoint::Responses);
    let mut agent = AgentStream::default();
    sink.pace(started + ttft).await?;
    if agent_api {
        for event in agent.opening(&meta, prompt_tokens) {
            sink.send(event).await?;
        }
    } else if let Some(event) = meta.role_event(
        job.request
            .continuous_usage
            .then(|| Usage::new(prompt_tokens, 0)),
    ) {
        sink.send(event?).await?;
    }
    // The answer so far, for the Responses events that repeat it whole.
    let mut text = String::new();
    let mut piece = String::with_capacity(16);
    let mut deadline = started + ttft;
    // A tool call is one piece, its arguments; text is a piece per token.
    let text_tokens = match meta.tool {
        Some(_) => 0,
        None => usize::MAX,
    };
    let tool_call = meta.tool.map(|_| ("", TOOL_ARGUMENTS));
    let words = tool_call.into_iter().chain(
        job.generation
            .words()
            .take(text_tokens)
            .map(|t| (t.sep, t.word)),
    );
    for (i, (sep, word)) in words.enumerate() {
        deadline += itl;
        sink.pace(deadline).await?;
        piece.clear();
        piece.push_str(sep);
        piece.push_str(word);
        let event = match (agent_api, meta.tool) {
            (true, _) => agent.delta(&meta, &piece),
            (false, Some(_)) => meta.tool_event()?,
            (false, None) => meta.token_event(&piece)?,
        };
        sink.send(event).await?;
        if job.endpoint == Endpoint::Responses && meta.tool.is_none() {
            text.push_str(&piece);
        }
        state
            .metrics
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
        if i == 0 {
            state.metrics.ttft.observe(job.arrived.elapsed());
        }
    }
    let usage = Usage::new(prompt_tokens, u64::from(job.tokens()));
    if agent_api {
        for event in agent.closing(&meta, &text, job.finish_reason(), usage) {
            sink.send(event).await?;
        }
        if job.endpoint == Endpoint::Responses {
            let whole = meta.completion_body(&text, job.finish_reason(), usage)?;
            state.store_response(&id, Bytes::from(whole));
        }
        state.metrics.e2e.observe(job.arrived.elapsed());
        return Ok(());
    }
    sink.send(meta.finish_event(job.finish_reason())?).await?;
    if job.request.include_usage {
        sink.send(meta.usage_event(usage)?).await?;
    }
    sink.send(Bytes::from_static(DONE_EVENT)).await?;
    state.metrics.e2e.observe(job.arrived.elapsed());
    Ok(())
}

// === impl Job ===

impl Job {
    /// What every body and event of the answer repeats.
    fn meta<'a>(&'a self, id: &'a str, model: &'a str) -> ResponseMeta<'a> {
        ResponseMeta {
            endpoint: self.endpoint,
            id,
            created: unix_now(),
            model,
            tool: self.request.tool.as_deref(),
            previous_response_id: self.request.previous_response_id.as_deref(),
        }
    }

    /// Generated tokens: the text's, or one for a tool call.
    fn tokens(&self) -> u32 {
        match self.request.tool {
            Some(_) => 1,
            None => self.generation.tokens(),
        }
    }

    fn finish_reason(&self) -> FinishReason {
        match self.request.tool {
            Some(_) => FinishReason::ToolCalls,
            None => self.generation.finish_reason(),
        }
    }
}

// === impl EventSink ===

impl EventSink {
    async fn send(&mut self, event: Bytes) -> Result<(), StreamEnd> {
        if self.reset_after == Some(self.sent) {
            return self.break_off().await;
        }
        self.tx
            .send(Ok(event))
            .await
            .map_err(|_| StreamEnd::ClientGone)?;
        self.sent += 1;
        Ok(())
    }

    /// Breaks the stream as `stream_break` says. If the client is already gone the break
    /// has nobody to reach; it is still the server's doing, so the result is the same.
    async fn break_off(&mut self) -> Result<(), StreamEnd> {
        match self.how {
            StreamBreak::Reset => {
                let _ = self.tx.send(Err(BodyError::InjectedReset)).await;
            }
            // Returning drops the sender: the body ends as if the stream were done.
            StreamBreak::End => {}
            StreamBreak::Stall => {
                self.tx.closed().await;
                return Err(StreamEnd::ClientGone);
            }
            StreamBreak::ErrorEvent => {
                let _ = self.tx.send(Ok(Bytes::from_static(ERROR_EVENT))).await;
                let _ = self.tx.send(Ok(Bytes::from_static(DONE_EVENT))).await;
            }
        }
        Err(StreamEnd::Injected)
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
