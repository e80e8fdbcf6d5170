//! `quantrouter profiles suggest --from URL...`: proposed quality numbers from the agreement
//! the replicas measured (`GET /admin/calibration`). It reads and prints; it never pushes.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use quantrouter_policy::ProfileSet;

use super::{block_on, CliError};
use crate::calibration::{suggest, CalibrationReport};

/// A replica that does not answer within this is reported and skipped.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Fetches the replicas' reports and prints a suggestion per profile and task class.
pub fn run(from: &[String], min_samples: u64, json: bool) -> Result<(), CliError> {
    let (set, reports) = block_on(fetch_all(from))?;
    let suggestions = suggest(&set, &reports, min_samples).map_err(CliError::Invalid)?;
    if json {
        let value = serde_json::to_value(&suggestions).map_err(|e| CliError::Io(e.to_string()))?;
        println!("{value:#}");
        return Ok(());
    }
    if suggestions.is_empty() {
        println!("no profile and task class has {min_samples} samples yet");
        return Ok(());
    }
    println!(
        "{:<20} {:<11} {:>8} {:>8} {:>10} {:>17}",
        "profile", "task_class", "samples", "current", "suggested", "95% interval"
    );
    for s in &suggestions {
        println!(
            "{:<20} {:<11} {:>8} {:>8.3} {:>10.3} {:>8.3} .. {:.3}",
            s.profile,
            s.task_class.as_str(),
            s.suggested.samples,
            s.current,
            s.suggested.estimate,
            s.suggested.low,
            s.suggested.high
        );
    }
    println!("\nsuggestions only: edit the profile set and push it to apply them");
    Ok(())
}

/// The active profile set (from the first replica that answers) and every report.
async fn fetch_all(from: &[String]) -> Result<(ProfileSet, Vec<CalibrationReport>), CliError> {
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut set = None;
    let mut reports = Vec::new();
    for base in from {
        let base = base.trim_end_matches('/');
        let report = match get_json(&client, &format!("{base}/admin/calibration")).await {
            Ok(value) => serde_json::from_value::<CalibrationReport>(value)
                .map_err(|e| format!("{base}/admin/calibration: {e}")),
            Err(e) => Err(e),
        };
        match report {
            Ok(report) => reports.push(report),
            Err(error) => {
                eprintln!("quantrouter: skipping {base}: {error}");
                continue;
            }
        }
        if set.is_none() {
            let profiles = get_json(&client, &format!("{base}/admin/profiles")).await;
            set = profiles
                .ok()
                .and_then(|v| serde_json::from_value::<ProfileSet>(v["profile_set"].clone()).ok());
        }
    }
    let set = set.ok_or_else(|| CliError::Io("no replica answered with its profile set".into()))?;
    Ok((set, reports))
}

async fn get_json(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<serde_json::Value, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let request = http::Request::get(uri)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("answered {}", response.status()));
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        serde_json::from_slice(&body.to_bytes()).map_err(|e| e.to_string())
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {TIMEOUT:?}"))?
}
