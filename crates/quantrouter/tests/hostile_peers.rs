//! Peers that misbehave, over real sockets: clients sending absurd headers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use http::StatusCode;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::{chat, send, Harness, SIMPLE};

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_header_numbers_are_a_400_over_http1_and_http2() {
    let h = Harness::start().await;
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(HttpConnector::new());
    let url = h.url("/v1/chat/completions");
    let body = chat("auto", SIMPLE);
    for (client, protocol) in [(&h.client, "HTTP/1.1"), (&h2, "h2c")] {
        for (header, value) in [
            ("x-quantrouter-timeout-ms", "1e22"),
            ("x-quantrouter-timeout-ms", "1e30"),
            ("x-quantrouter-timeout-ms", "1e308"),
            ("x-quantrouter-timeout-ms", "86400001"),
            ("x-quantrouter-timeout-ms", "0"),
            ("x-quantrouter-latency-budget-ms", "1e30"),
        ] {
            let r = send(client, "POST", &url, &body, &[JSON, (header, value)]).await;
            let case = format!("{protocol} {header}: {value}");
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{case}");
            let error = &r.json()["error"];
            assert_eq!(error["type"], "invalid_request_error", "{case}");
            assert_eq!(error["param"], header, "{case}");
        }
        // The largest deadline allowed is served.
        let r = send(
            client,
            "POST",
            &url,
            &body,
            &[JSON, ("x-quantrouter-timeout-ms", "86400000")],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{protocol}");
    }
}
