//! Correctness at the edges, over real sockets: answers the quality check must not throw
//! away (tool calls, refusals, `n > 1`), prompts without text, servers that are not vLLM
//! (llama.cpp's early response head, its usage chunk, CRLF event separators), upstreams
//! that go silent or answer garbage, requests that are not quite JSON, and what a client
//! sees of the router's inside.
//!
//! The unusual upstreams are scripted here over raw TCP: vllm-sim plays a well-behaved vLLM.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use quantrouter::server::Server;
use quantrouter_policy::{ProfileSet, StaticUpstream, StreamCheck, Upstream, DEFAULT_PROFILE_SET};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What every test waits for at most before calling a response missing.
const PATIENCE: Duration = Duration::from_secs(20);

/// The completion requests a scripted upstream received (bodies), in order.
type Received = Arc<Mutex<Vec<serde_json::Value>>>;

/// An upstream on a free loopback port that reads each request and leaves the answer to
/// `script` (given the request's JSON body and the raw socket). The router's queue scrapes
/// (`GET /metrics`) get a 404. Each connection serves one request.
async fn scripted<S, F>(script: S) -> (String, Received)
where
    S: Fn(serde_json::Value, TcpStream) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received = Received::default();
    let seen = Arc::clone(&received);
    let script = Arc::new(script);
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let (script, seen) = (Arc::clone(&script), Arc::clone(&seen));
            tokio::spawn(async move {
                let Some((method, body)) = read_request(&mut stream).await else {
                    return;
                };
                if method != "POST" {
                    let _ = stream
                        .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                        .await;
                    return;
                }
                let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
                seen.lock().unwrap().push(body.clone());
                script(body, stream).await;
            });
        }
    });
    (url, received)
}

/// Reads one request head and its `content-length` body.
async fn read_request(stream: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        let Ok(httparse::Status::Complete(len)) = request.parse(&buf) else {
            continue;
        };
        let length: usize = request
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .map_or(0, |h| {
                std::str::from_utf8(h.value).unwrap().parse().unwrap()
            });
        let method = request.method.unwrap().to_owned();
        while buf.len() < len + length {
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        return Some((method, buf[len..len + length].to_vec()));
    }
}

/// A whole JSON answer, then the connection closes.
async fn answer_json(mut stream: TcpStream, body: serde_json::Value) {
    let body = body.to_string();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
}

/// The head of a chunked SSE stream, sent at once (as llama.cpp does, before prefill).
async fn sse_head(stream: &mut TcpStream) {
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
}

/// One HTTP chunk of a chunked body.
async fn send_chunk(stream: &mut TcpStream, data: &str) {
    let chunk = format!("{:x}\r\n{data}\r\n", data.len());
    stream.write_all(chunk.as_bytes()).await.unwrap();
}

async fn end_chunks(stream: &mut TcpStream) {
    stream.write_all(b"0\r\n\r\n").await.unwrap();
}

/// Waits until the router closes the connection (it gave up, or the answer is done).
async fn until_closed(mut stream: TcpStream) {
    let mut byte = [0u8; 1];
    let _ = stream.read(&mut byte).await;
}

/// The embedded profile set, every profile on `url`, ids prefixed by `tag` so the test's
/// metric series are its own (tests share the process-wide recorder).
fn set_on(url: &str, tag: &str) -> ProfileSet {
    let mut set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    for p in &mut set.profiles {
        p.id = format!("{tag}-{}", p.id);
        p.upstream = Upstream::Static(StaticUpstream::new(vec![url.to_owned()]));
    }
    set.default_profile = format!("{tag}-{}", set.default_profile);
    set
}

fn url(router: &Server, path: &str) -> String {
    format!("http://{}{path}", router.public_addr())
}

async fn post(router: &Server, path: &str, body: &str) -> Reply {
    send(
        &client(),
        "POST",
        &url(router, path),
        body,
        &[("content-type", "application/json")],
    )
    .await
}

/// A request body that may not be UTF-8.
async fn post_bytes(router: &Server, body: Vec<u8>) -> Reply {
    let req = Request::post(url(router, "/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = tokio::time::timeout(PATIENCE, client().request(req))
        .await
        .unwrap()
        .unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// The value of the series `name{labels…}` on the admin port's `/metrics` (0 when absent).
async fn metric(router: &Server, name: &str, labels: &[&str]) -> f64 {
    let page = send(
        &client(),
        "GET",
        &format!("http://{}/metrics", router.admin_addr()),
        "",
        &[],
    )
    .await;
    String::from_utf8(page.body.to_vec())
        .unwrap()
        .lines()
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{'))
                && labels.iter().all(|label| l.contains(label))
        })
        .map_or(0.0, |l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

fn chat_completion(message: serde_json::Value) -> serde_json::Value {
    serde_json::json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
        "model": "m", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}})
}

// 1. Tool calls and refusals are answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_and_refusals_pass_the_answer_checks() {
    let (upstream, received) = scripted(|request, stream| {
        let call = serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]);
        // How each server says "no text": vLLM and OpenAI `null`, llama.cpp `""`.
        let message = match request["user"].as_str() {
            Some("vllm") => {
                serde_json::json!({"role": "assistant", "content": null, "tool_calls": call})
            }
            Some("llamacpp") => {
                serde_json::json!({"role": "assistant", "content": "", "tool_calls": call})
            }
            _ => serde_json::json!({"role": "assistant", "content": null,
                "refusal": "I can't help with that.", "tool_calls": []}),
        };
        answer_json(stream, chat_completion(message))
    })
    .await;
    let router = start_router(set_on(&upstream, "tools"), |_| {}).await;
    for user in ["vllm", "llamacpp", "refusal"] {
        let body = serde_json::json!({"model": "auto", "user": user, "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
        let r = post(&router, "/v1/chat/completions", &body.to_string()).await;
        assert_eq!(r.status, StatusCode::OK, "{user}");
        assert_eq!(r.header("x-quantrouter-tier"), "int4", "{user}");
        assert_eq!(r.header("x-quantrouter-fallback"), "", "{user}: not re-run");
        let message = &r.json()["choices"][0]["message"];
        assert!(
            message["tool_calls"][0]["function"]["name"] == "get_weather"
                || message["refusal"].is_string(),
            "{user}: {message}"
        );
    }
    assert_eq!(received.lock().unwrap().len(), 3, "one upstream call each");
}

// 2. `n > 1`: each choice on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_of_an_n_answer_is_judged_on_its_own() {
    let (upstream, received) = scripted(|request, stream| {
        let n = request["n"].as_u64().unwrap_or(1) as usize;
        let cheap = request["model"] == "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4";
        let contents = match request["user"].as_str() {
            // Alone each is fine; joined they are `{"a":8}{"a":8}` and a loop.
            Some("json") => vec!["{\"a\":8}"; n],
            Some("short") => vec!["The answer is eight. "; n],
            // The cheap tier leaves its second choice empty; the better one does not.
            _ if cheap => vec!["Paris.", ""],
            _ => vec!["Paris.", "Paris."],
        };
        let choices: Vec<serde_json::Value> = contents
            .iter()
            .enumerate()
            .map(|(i, content)| {
                serde_json::json!({"index": i, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": content}})
            })
            .collect();
        answer_json(
            stream,
            serde_json::json!({"object": "chat.completion", "choices": choices}),
        )
    })
    .await;
    let router = start_router(set_on(&upstream, "choices"), |_| {}).await;
    let request = |user: &str, n: u32, json: bool| {
        let mut body = serde_json::json!({"model": "auto", "user": user, "n": n,
            "messages": [{"role": "user", "content": "What is five plus three?"}]});
        if json {
            body["response_format"] = serde_json::json!({"type": "json_object"});
        }
        body.to_string()
    };
    for (user, n, json) in [("json", 2, true), ("short", 3, false)] {
        let r = post(&router, "/v1/chat/completions", &request(user, n, json)).await;
        assert_eq!(r.status, StatusCode::OK, "{user}");
        assert_ne!(
            r.header("x-quantrouter-tier"),
            "fp16",
            "{user}: a checked tier"
        );
        assert_eq!(r.header("x-quantrouter-fallback"), "", "{user}: not re-run");
        assert_eq!(r.json()["choices"].as_array().unwrap().len(), n as usize);
    }
    assert_eq!(received.lock().unwrap().len(), 2);
    // One empty choice among good ones is still an empty answer.
    let r = post(
        &router,
        "/v1/chat/completions",
        &request("one-empty", 2, false),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-reason"), "fallback_quality");
    assert_eq!(received.lock().unwrap().len(), 4);
}

// 2b. `n > 1` streams too: the stream-start check judges each choice on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_of_an_n_stream_is_judged_on_its_own() {
    let (upstream, received) = scripted(|request, mut stream| async move {
        let n = request["n"].as_u64().unwrap();
        sse_head(&mut stream).await;
        // Eight good answers, a token of each in turn, as vLLM interleaves them: joined,
        // "The The The … capital capital capital …" reads as a loop.
        let answer = "The capital of France is Paris, a city on the Seine that is known \
                      for its old bridges, its museums and its parks.";
        for token in answer.split_inclusive(' ') {
            for i in 0..n {
                let event = serde_json::json!({"object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": {"content": token}}]});
                send_chunk(&mut stream, &format!("data: {event}\n\n")).await;
            }
        }
        send_chunk(&mut stream, "data: [DONE]\n\n").await;
        end_chunks(&mut stream).await;
    })
    .await;
    let mut set = set_on(&upstream, "nstream");
    set.policy.stream_check = Some(StreamCheck {
        // Counted per choice; counted over the interleaved events, the start is a loop.
        tokens: 16,
        max_hold_ms: 10_000,
    });
    let router = start_router(set, |_| {}).await;
    let body = serde_json::json!({"model": "auto", "stream": true, "n": 8,
        "messages": [{"role": "user", "content": SIMPLE}]});
    let r = post(&router, "/v1/chat/completions", &body.to_string()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-tier"), "int4", "a checked tier");
    assert_eq!(r.header("x-quantrouter-fallback"), "", "not re-run");
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert_eq!(text.matches("parks.").count(), 8, "{text}");
    assert_eq!(received.lock().unwrap().len(), 1, "asked once");
}

// 3. A message without text is routed and forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_text_is_routed_as_the_simplest_prompt_and_forwarded() {
    let (upstream, seen) = capture_upstream().await;
    let router = start_router(set_on(&upstream, "image"), |_| {}).await;
    let image = r#"{"model":"auto","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]}]}"#;
    let r = post(&router, "/v1/chat/completions", image).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.header("x-quantrouter-tier"), "int4");
    assert_eq!(r.header("x-quantrouter-complexity"), "0.000");
    let forwarded = seen.lock().unwrap()[0].1.clone();
    assert!(
        String::from_utf8_lossy(&forwarded).contains("data:image/png;base64,iVBORw0KGgo="),
        "the image went upstream"
    );
    let blank = chat("auto", "   ");
    let r = post(&router, "/v1/chat/completions", &blank).await;
    assert_eq!(r.status, StatusCode::OK);
    let route = post(&router, "/v1/route", image).await;
    assert_eq!(route.status, StatusCode::OK);
    assert_eq!(route.json()["complexity"], 0.0);
    // No message at all is still no request.
    for body in [r#"{"model":"auto","messages":[]}"#, r#"{"model":"auto"}"#] {
        let r = post(&router, "/v1/chat/completions", body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(r.json()["error"]["param"], "messages");
    }
    assert_eq!(seen.lock().unwrap().len(), 2);
}

/// A streamed chat answer after a `prefill` pause that follows the head, llama.cpp style.
const PREFILL: Duration = Duration::from_millis(600);

async fn llamacpp_stream(mut stream: TcpStream) {
    sse_head(&mut stream).await;
    // llama.cpp's role-only chunk comes at once; it carries no output, so TTFT waits on.
    let role = r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#;
    send_chunk(&mut stream, &format!("{role}\n\n")).await;
    tokio::time::sleep(PREFILL).await;
    for delta in [r#"{"content":"Par"}"#, r#"{"content":"is"}"#] {
        let event = format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n");
        send_chunk(&mut stream, &event).await;
    }
    send_chunk(&mut stream, "data: [DONE]\n\n").await;
    end_chunks(&mut stream).await;
}

// 5. Time to first token at the first output, and the header timeout covers prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_to_first_token_is_the_first_output_and_prefill_has_the_header_timeout() {
    let (upstream, _) = scripted(|_, stream| llamacpp_stream(stream)).await;
    // The prefill pause is longer than the idle timeout, well inside the header timeout.
    let router = start_router(set_on(&upstream, "ttft"), |c| {
        c.resilience.idle_timeout = Duration::from_millis(200);
    })
    .await;
    let r = post(&router, "/v1/chat/completions", &simple_stream(8)).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(!text.contains("\"error\""), "cut short: {text}");
    assert!(
        text.contains("\"Par\"") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    let labels = ["profile=\"ttft-llama8b-awq\""];
    let name = "quantrouter_time_to_first_token_seconds";
    assert_eq!(
        metric(&router, &format!("{name}_count"), &labels).await,
        1.0
    );
    let ttft = metric(&router, &format!("{name}_sum"), &labels).await;
    assert!(
        ttft >= PREFILL.as_secs_f64(),
        "TTFT {ttft} s counts from the first output, after the {PREFILL:?} prefill"
    );

    // No output within the header timeout: the stream ends with a timeout event naming it.
    let (silent, _) = scripted(|_, mut stream| async move {
        sse_head(&mut stream).await;
        until_closed(stream).await;
    })
    .await;
    let router = start_router(set_on(&silent, "prefill"), |c| {
        c.client.header_timeout = Duration::from_millis(300);
        c.resilience.idle_timeout = Duration::from_millis(100);
    })
    .await;
    let r = post(&router, "/v1/chat/completions", &simple_stream(8)).await;
    let event = last_sse_event(std::str::from_utf8(&r.body).unwrap());
    assert_eq!(event["error"]["code"], "timeout");
    assert!(
        event["error"]["message"]
            .as_str()
            .unwrap()
            .contains("header timeout"),
        "{event}"
    );
}

// 6. Usage from whichever chunk carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_in_the_last_choice_chunk_of_a_completion_stream_is_counted() {
    let (upstream, received) = scripted(|_, mut stream| async move {
        sse_head(&mut stream).await;
        for text in ["Once", " upon"] {
            let event = format!(
                "data: {{\"object\":\"text_completion\",\"choices\":[{{\"text\":\"{text}\",\"index\":0,\"finish_reason\":null}}]}}\n\n"
            );
            send_chunk(&mut stream, &event).await;
        }
        // llama.cpp: the usage rides on the last choice chunk, ignoring `stream_options`.
        send_chunk(&mut stream, "data: {\"object\":\"text_completion\",\"choices\":[{\"text\":\"\",\"index\":0,\"finish_reason\":\"stop\"}],\"usage\":{\"completion_tokens\":9,\"prompt_tokens\":5,\"total_tokens\":14}}\n\n").await;
        send_chunk(&mut stream, "data: [DONE]\n\n").await;
        end_chunks(&mut stream).await;
    })
    .await;
    let router = start_router(set_on(&upstream, "llamausage"), |_| {}).await;
    let body = r#"{"model":"auto","prompt":"Once","stream":true,"max_tokens":3}"#;
    let r = post(&router, "/v1/completions", body).await;
    assert_eq!(r.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&r.body);
    assert!(text.contains("\"finish_reason\":\"stop\""), "{text}");
    assert_eq!(
        received.lock().unwrap()[0]["stream_options"]["include_usage"],
        true
    );
    let mut tokens = Vec::new();
    for direction in ["direction=\"input\"", "direction=\"output\""] {
        let labels = ["profile=\"llamausage-llama8b-awq\"", direction];
        tokens.push(metric(&router, "quantrouter_tokens_total", &labels).await);
    }
    assert_eq!(tokens, [5.0, 9.0]);
}

// 17. CRLF-separated events stream one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crlf_events_stream_one_by_one_while_the_upstream_is_still_sending() {
    let go_on = Arc::new(Notify::new());
    let signal = Arc::clone(&go_on);
    let (upstream, _) = scripted(move |_, mut stream| {
        let signal = Arc::clone(&signal);
        async move {
            sse_head(&mut stream).await;
            let token = |t: &str| {
                format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{t}\"}}}}]}}\r\n\r\n")
            };
            send_chunk(&mut stream, &token("Hello")).await;
            // The rest only once the test saw the first event reach the client.
            signal.notified().await;
            send_chunk(&mut stream, &token(" world")).await;
            send_chunk(&mut stream, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}\r\n\r\n").await;
            send_chunk(&mut stream, "data: [DONE]\r\n\r\n").await;
            end_chunks(&mut stream).await;
        }
    })
    .await;
    let router = start_router(set_on(&upstream, "crlf"), |_| {}).await;
    // The SDK default: no `stream_options`, so the router adds and strips the usage event.
    let req = Request::post(url(&router, "/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(simple_stream(8))))
        .unwrap();
    let response = client().request(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut text = String::new();
    while !text.contains("\r\n\r\n") {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("the first event arrives while the upstream waits")
            .unwrap()
            .unwrap();
        text.push_str(std::str::from_utf8(&frame.into_data().unwrap()).unwrap());
    }
    assert!(text.contains("Hello"), "{text}");
    go_on.notify_one();
    let rest = tokio::time::timeout(PATIENCE, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    text.push_str(std::str::from_utf8(&rest).unwrap());
    assert!(
        text.contains(" world") && text.ends_with("data: [DONE]\r\n\r\n"),
        "{text}"
    );
    assert!(
        !text.contains("usage"),
        "the usage event is the router's: {text}"
    );
    let output = metric(
        &router,
        "quantrouter_tokens_total",
        &["profile=\"crlf-llama8b-awq\"", "direction=\"output\""],
    )
    .await;
    assert_eq!(output, 2.0);
}

// 18. The idle timeout holds for an answer read whole for the quality check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_answer_that_goes_silent_ends_at_the_idle_timeout() {
    let (upstream, _) = scripted(|_, mut stream| async move {
        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 400\r\n\r\n{\"choices\":";
        stream.write_all(head.as_bytes()).await.unwrap();
        until_closed(stream).await;
    })
    .await;
    // The default deadline (600 s) stays: only the idle timeout can end this in time.
    let router = start_router(set_on(&upstream, "silent"), |c| {
        c.resilience.idle_timeout = Duration::from_millis(300);
    })
    .await;
    let r = post(&router, "/v1/chat/completions", &chat("auto", SIMPLE)).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    let error = &r.json()["error"];
    assert!(
        error["message"].as_str().unwrap().contains("sent nothing"),
        "{error}"
    );
    let idle = metric(
        &router,
        "quantrouter_upstream_errors_total",
        &["profile=\"silent-llama8b-awq\"", "kind=\"idle_timeout\""],
    )
    .await;
    assert_eq!(idle, 1.0);
}

// 19. Request validation: nothing after the object, UTF-8 throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailing_bytes_and_invalid_utf8_anywhere_are_rejected() {
    let (upstream, seen) = capture_upstream().await;
    let router = start_router(set_on(&upstream, "strict"), |_| {}).await;
    let good = chat("auto", SIMPLE);
    let mut invalid_in_ignored = br#"{"model":"auto","x_vendor":""#.to_vec();
    invalid_in_ignored.extend_from_slice(b"\xff\xfe");
    invalid_in_ignored.extend_from_slice(br#"","messages":[{"role":"user","content":"hi"}]}"#);
    let mut invalid_in_text =
        br#"{"model":"auto","messages":[{"role":"user","content":"caf"#.to_vec();
    invalid_in_text.extend_from_slice(b"\xe9\"}]}");
    let bad: Vec<(&str, Vec<u8>)> = vec![
        (
            "text after the object",
            format!("{good} trailing").into_bytes(),
        ),
        ("a second object", format!("{good}{good}").into_bytes()),
        ("a stray brace", format!("{good}}}").into_bytes()),
        ("invalid UTF-8 in an unread field", invalid_in_ignored),
        ("invalid UTF-8 in the prompt", invalid_in_text),
    ];
    for (name, body) in bad {
        let r = post_bytes(&router, body).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{name}");
        let error = &r.json()["error"];
        assert_eq!(error["type"], "invalid_request_error", "{name}");
        assert_eq!(error["code"], "invalid_request", "{name}");
        assert!(error.get("param").is_some(), "{name}: {error}");
    }
    assert!(seen.lock().unwrap().is_empty(), "nothing went upstream");
    // Whitespace after the object is still JSON.
    let r = post_bytes(&router, format!("{good}\r\n \n").into_bytes()).await;
    assert_eq!(r.status, StatusCode::OK);
}

// 20. What clients see of the inside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_garbage_is_502_and_no_error_shows_an_upstream_address() {
    let (garbage, _) = scripted(|_, mut stream| async move {
        let _ = stream.write_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n").await;
    })
    .await;
    let router = start_router(set_on(&garbage, "garbage"), |_| {}).await;
    let r = post(&router, "/v1/chat/completions", &chat("auto", SIMPLE)).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "bad_gateway");
    let host_port = garbage.trim_start_matches("http://");
    assert!(!String::from_utf8_lossy(&r.body).contains(host_port));

    // Down (503) and silent before the head (504): the profile is named, not the address.
    let (_refusing, address) = refusing_address();
    let down = format!("http://{address}");
    let (hung, _) = scripted(|_, stream| until_closed(stream)).await;
    for (upstream, status) in [
        (down, StatusCode::SERVICE_UNAVAILABLE),
        (hung, StatusCode::GATEWAY_TIMEOUT),
    ] {
        let router = start_router(set_on(&upstream, "inside"), |c| {
            c.client.header_timeout = Duration::from_millis(200);
        })
        .await;
        let r = post(&router, "/v1/chat/completions", &chat("auto", SIMPLE)).await;
        assert_eq!(r.status, status);
        let body = String::from_utf8_lossy(&r.body);
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(message.contains("inside-llama8b"), "{message}");
        let host_port = upstream.trim_start_matches("http://");
        assert!(!body.contains(host_port), "{body}");
        assert!(!body.contains("127.0.0.1"), "{body}");
    }
}
