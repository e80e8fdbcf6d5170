//! The few control-plane calls the suite makes: readiness, `/metrics`, `/admin/profiles` and
//! the simulator's fault switch. Load itself goes through [`crate::run()`].

use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A control call that takes longer than this is a failure: they are all loopback reads of a
/// page or a switch.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

type ControlClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> &'static ControlClient {
    static CLIENT: OnceLock<ControlClient> = OnceLock::new();
    CLIENT.get_or_init(|| Client::builder(TokioExecutor::new()).build_http())
}

/// `GET url`: status and body.
pub async fn get(url: &str) -> anyhow::Result<(u16, String)> {
    call(Method::GET, url, None).await
}

/// `method url` with an optional JSON body: status and body.
pub async fn call(method: Method, url: &str, json: Option<&str>) -> anyhow::Result<(u16, String)> {
    let mut builder = Request::builder().method(method).uri(url);
    if json.is_some() {
        builder = builder.header(http::header::CONTENT_TYPE, "application/json");
    }
    let body = Full::new(Bytes::from(json.unwrap_or_default().to_owned()));
    let request = builder.body(body).context("bad control request")?;
    let exchange = async {
        let response = client().request(request).await?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await?.to_bytes();
        anyhow::Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .with_context(|| format!("{url} did not answer within {CALL_TIMEOUT:?}"))?
        .with_context(|| format!("cannot reach {url}"))
}

/// The sum of a metric's samples on a Prometheus text page. Each series counts once: the
/// first sample of a series is its own value.
pub fn metric_sum(page: &str, name: &str) -> f64 {
    let mut seen = std::collections::HashSet::new();
    page.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.rsplit_once(' '))
        .filter(|(series, _)| {
            *series == name
                || series
                    .strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{'))
        })
        .filter(|(series, _)| seen.insert(*series))
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sum_adds_each_series_once_and_ignores_other_names() {
        let page = "\
# HELP cost_total Dollars.
# TYPE cost_total counter
cost_total{profile=\"a b\"} 0.5
cost_total{profile=\"c\"} 0.25
cost_total{profile=\"c\"} 9
cost_total_extra 100
counterfactual_cost_total{profile=\"a\"} 7
";
        assert_eq!(metric_sum(page, "cost_total"), 0.75);
        assert_eq!(metric_sum(page, "counterfactual_cost_total"), 7.0);
        assert_eq!(metric_sum(page, "missing"), 0.0);
    }
}
