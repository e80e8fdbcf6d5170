use std::sync::Mutex;

use http_body_util::BodyExt;
use quantrouter_policy::{ProfileIndex, ProfileSet, DEFAULT_PROFILE_SET};

use super::*;
use crate::resilience::ResilienceConfig;

/// A hook that hands out prepared continuations and records what it was asked.
#[derive(Default, Clone)]
struct Script(Arc<Mutex<ScriptState>>);

#[derive(Default)]
struct ScriptState {
    continuations: Vec<Option<&'static str>>,
    asked: Vec<(BodyError, String, u64)>,
    refused: Vec<&'static str>,
}

impl Resume for Script {
    fn resume(&self, broken: Broken) -> Asked {
        let mut state = self.0.lock().unwrap();
        state
            .asked
            .push((broken.failure, broken.delivered, broken.tokens));
        let next = state.continuations.remove(0);
        let continuation = next.map(|body| Continuation {
            incoming: UpstreamIncoming::buffered(Bytes::from_static(body.as_bytes())),
            held: None,
            limits: limits(),
            served: served(),
        });
        Box::pin(async move { continuation })
    }

    fn refuse(&self, _: &Broken, why: &'static str) {
        self.0.lock().unwrap().refused.push(why);
    }
}

fn limits() -> TimeLimits {
    let deadline = Instant::now() + Duration::from_secs(60);
    TimeLimits {
        idle: Duration::from_secs(30),
        deadline,
        first_output_by: deadline,
    }
}

fn served() -> Served {
    let config = ResilienceConfig::default();
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    Served {
        profile: ProfileIndex::new(0),
        endpoint: Arc::new(Endpoint::new("http://127.0.0.1:1", &config, Instant::now())),
        attempts: 1,
        telemetry: Arc::new(ProfileTelemetry::new(&set.profiles[0])),
        prices: PerToken::of(&set.profiles[0]),
    }
}

fn stream(body: &'static str, script: &Script, max_resumes: u32) -> Resuming {
    let incoming = UpstreamIncoming::buffered(Bytes::from_static(body.as_bytes()));
    let mut resuming = Resuming::new(Guarded::new(TimeLimited::new(incoming, limits()), None));
    let hook = Box::new(script.clone());
    let idle = Duration::from_secs(30);
    resuming.resumable(Resumable::new(hook, served(), max_resumes, idle));
    resuming
}

/// Everything the body sends, and how it ends.
async fn read(body: Resuming) -> (String, Option<BodyError>) {
    read_pinned(std::pin::pin!(body)).await
}

async fn read_pinned(mut body: Pin<&mut Resuming>) -> (String, Option<BodyError>) {
    let mut out = String::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => out.push_str(std::str::from_utf8(&frame.into_data().unwrap()).unwrap()),
            Err(error) => return (out, Some(error)),
        }
    }
    (out, None)
}

const ROLE: &str = "data: {\"id\":\"a\",\"model\":\"m\",\"created\":1,\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
const HELLO: &str = "data: {\"id\":\"a\",\"model\":\"m\",\"created\":1,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"}}]}\n\n";
const FINISH: &str = "data: {\"id\":\"a\",\"model\":\"m\",\"created\":1,\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n";
const DONE: &str = "data: [DONE]\n\n";

/// A continuation: its own role, the rest of the text, its finish.
const REST: &str = concat!(
    "data: {\"id\":\"b\",\"model\":\"m2\",\"created\":2,\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    "data: {\"id\":\"b\",\"model\":\"m2\",\"created\":2,\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"}}]}\n\n",
    "data: {\"id\":\"b\",\"model\":\"m2\",\"created\":2,\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
);

fn texts(out: &str) -> (String, usize, Vec<String>) {
    let mut text = String::new();
    let mut finishes = 0;
    let mut ids = Vec::new();
    for event in out.split("\n\n").filter(|e| e.starts_with("data: {")) {
        let chunk: serde_json::Value = serde_json::from_str(&event[6..]).unwrap();
        let choice = &chunk["choices"][0];
        text.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        finishes += usize::from(!choice["finish_reason"].is_null());
        ids.push(chunk["id"].as_str().unwrap().to_owned());
    }
    (text, finishes, ids)
}

#[tokio::test]
async fn a_whole_stream_passes_untouched_and_asks_for_nothing() {
    let script = Script::default();
    let whole: &'static str = Box::leak(format!("{ROLE}{HELLO}{FINISH}{DONE}").into_boxed_str());
    let (out, end) = read(stream(whole, &script, 1)).await;
    assert_eq!((out.as_str(), end), (whole, None));
    assert!(script.0.lock().unwrap().asked.is_empty());
}

#[tokio::test]
async fn a_body_that_ends_without_a_finish_goes_on_with_its_continuation() {
    let script = Script::default();
    script.0.lock().unwrap().continuations.push(Some(REST));
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}").into_boxed_str());
    let mut body = std::pin::pin!(stream(broken, &script, 1));
    let (out, end) = read_pinned(body.as_mut()).await;
    assert_eq!(end, None, "{out}");
    // The books learn that the continuation generated the text after the first token.
    let handovers = body.handovers();
    assert_eq!(handovers.len(), 1);
    assert_eq!(handovers[0].after, 1);
    let (text, finishes, ids) = texts(&out);
    assert_eq!((text.as_str(), finishes), ("Hello world", 1));
    assert!(ids.iter().all(|id| id == "a"), "one id throughout: {ids:?}");
    assert_eq!(out.matches("\"role\"").count(), 1, "one role: {out}");
    assert!(out.ends_with(DONE));
    let asked = &script.0.lock().unwrap().asked;
    assert_eq!(
        asked.as_slice(),
        [(BodyError::Incomplete, "Hello".to_owned(), 1)]
    );
}

#[tokio::test]
async fn done_without_a_finish_reason_ends_a_whole_stream() {
    let script = Script::default();
    let whole: &'static str = Box::leak(format!("{ROLE}{HELLO}{DONE}").into_boxed_str());
    let mut body = std::pin::pin!(stream(whole, &script, 1));
    let (out, end) = read_pinned(body.as_mut()).await;
    assert_eq!((out.as_str(), end), (whole, None));
    let state = script.0.lock().unwrap();
    assert!(state.asked.is_empty() && state.refused.is_empty());
    assert!(body.handovers().is_empty());
}

#[tokio::test]
async fn an_error_event_is_not_relayed_when_a_continuation_follows() {
    let script = Script::default();
    script.0.lock().unwrap().continuations.push(Some(REST));
    let error = "data: {\"error\": {\"message\": \"engine dead\"}}\n\n";
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}{error}{DONE}").into_boxed_str());
    let (out, end) = read(stream(broken, &script, 1)).await;
    assert_eq!(end, None);
    assert!(!out.contains("engine dead"), "{out}");
    assert_eq!(texts(&out).0, "Hello world");
    assert_eq!(script.0.lock().unwrap().asked[0].0, BodyError::ErrorEvent);
}

#[tokio::test]
async fn a_failed_continuation_ends_the_stream_with_the_first_failure() {
    let script = Script::default();
    script.0.lock().unwrap().continuations.push(None);
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}").into_boxed_str());
    let (out, end) = read(stream(broken, &script, 1)).await;
    assert_eq!(end, Some(BodyError::Incomplete));
    assert_eq!(texts(&out).0, "Hello");
}

#[tokio::test]
async fn without_resumes_left_a_broken_stream_ends_as_it_would_without_resumption() {
    let script = Script::default();
    let error = "data: {\"error\": {\"message\": \"engine dead\"}}\n\n";
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}{error}{DONE}").into_boxed_str());
    let (out, end) = read(stream(broken, &script, 0)).await;
    assert_eq!((out.as_str(), end), (broken, None), "passed as it came");
    assert_eq!(
        script.0.lock().unwrap().refused.as_slice(),
        ["no resumes are left"]
    );

    // A continuation that breaks too, with one resume allowed, is not resumed again.
    let script = Script::default();
    let rest_broken =
        "data: {\"id\":\"b\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" wor\"}}]}\n\n";
    script
        .0
        .lock()
        .unwrap()
        .continuations
        .push(Some(rest_broken));
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}").into_boxed_str());
    let (out, end) = read(stream(broken, &script, 1)).await;
    assert_eq!(end, None);
    assert_eq!(texts(&out).0, "Hello wor");
    assert_eq!(script.0.lock().unwrap().asked.len(), 1);
}

#[tokio::test]
async fn a_tool_call_stream_is_refused_and_passes_as_it_came() {
    let script = Script::default();
    let call = "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\"}}]}}]}\n\n";
    let broken: &'static str = Box::leak(format!("{ROLE}{call}").into_boxed_str());
    let (out, end) = read(stream(broken, &script, 1)).await;
    assert_eq!((out.as_str(), end), (broken, None));
    let state = script.0.lock().unwrap();
    assert!(state.asked.is_empty());
    assert_eq!(state.refused.as_slice(), ["a tool call was streamed"]);
}

#[tokio::test(start_paused = true)]
async fn a_long_wait_for_the_continuation_sends_comments() {
    struct Slow;
    impl Resume for Slow {
        fn resume(&self, _: Broken) -> Asked {
            Box::pin(async {
                tokio::time::sleep(Duration::from_secs(12)).await;
                Some(Continuation {
                    incoming: UpstreamIncoming::buffered(Bytes::from_static(REST.as_bytes())),
                    held: None,
                    limits: limits(),
                    served: served(),
                })
            })
        }
        fn refuse(&self, _: &Broken, _: &'static str) {}
    }
    let broken: &'static str = Box::leak(format!("{ROLE}{HELLO}").into_boxed_str());
    let incoming = UpstreamIncoming::buffered(Bytes::from_static(broken.as_bytes()));
    let mut resuming = Resuming::new(Guarded::new(TimeLimited::new(incoming, limits()), None));
    let idle = Duration::from_secs(10);
    resuming.resumable(Resumable::new(Box::new(Slow), served(), 1, idle));
    let (out, end) = read(resuming).await;
    assert_eq!(end, None);
    assert_eq!(out.matches(": resuming the stream\n\n").count(), 2, "{out}");
    assert_eq!(texts(&out).0, "Hello world");
}
