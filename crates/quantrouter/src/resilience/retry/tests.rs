use std::time::Duration;

use super::*;

fn io(message: &str) -> BoxError {
    std::io::Error::other(message.to_owned()).into()
}

use crate::upstream::BoxError;

#[test]
fn only_requests_that_never_left_are_sent_again_at_once() {
    let endpoint = || "http://a:1".to_owned();
    let unsent = UpstreamError::Unsent {
        endpoint: endpoint(),
        source: io("connection closed"),
    };
    assert_eq!(unsent.sent(), Sent::No);
    assert_eq!(is_retryable(Outcome::Failed(&unsent)), Verdict::Resend);

    // Nothing sent, but the endpoint is unreachable: another one, counted.
    let refused = UpstreamError::Connect {
        endpoint: endpoint(),
        source: io("refused"),
    };
    assert_eq!(refused.sent(), Sent::No);
    assert_eq!(is_retryable(Outcome::Failed(&refused)), Verdict::Retry);

    // The upstream may have the request: never resent on the quiet.
    let possibly_sent = [
        UpstreamError::Exchange {
            endpoint: endpoint(),
            source: io("closed before a response head"),
        },
        UpstreamError::InvalidResponse {
            endpoint: endpoint(),
            source: io("not HTTP"),
        },
        UpstreamError::HeaderTimeout {
            endpoint: endpoint(),
            timeout: Duration::from_secs(1),
        },
    ];
    for error in &possibly_sent {
        assert_eq!(error.sent(), Sent::Possibly, "{error}");
        assert_eq!(
            is_retryable(Outcome::Failed(error)),
            Verdict::Retry,
            "{error}"
        );
    }
}

#[test]
fn statuses_that_mean_the_attempt_did_not_happen_are_retried_and_no_others() {
    for status in [429, 502, 503, 504] {
        let status = StatusCode::from_u16(status).unwrap();
        assert_eq!(is_retryable(Outcome::Answered(status)), Verdict::Retry);
    }
    for status in [200, 201, 400, 401, 404, 413, 422, 500, 501] {
        let status = StatusCode::from_u16(status).unwrap();
        assert_eq!(
            is_retryable(Outcome::Answered(status)),
            Verdict::Done,
            "{status}"
        );
    }
}
