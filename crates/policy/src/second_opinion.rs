//! `policy.second_opinion` (`docs/routing.md`, "A second opinion"): which requests a cheap
//! tier is asked to rate, and what its one-digit rating means to the risk rule. The asking
//! is the router's; this is the arithmetic.

use serde::Serialize;

use crate::profile::SecondOpinion;

/// A tier's rating of a request's difficulty: one digit, 0 (trivial) to 9 (beyond it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct Rating(u8);

/// What a second opinion did to a decision, for the explain output.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SecondOpinionUse {
    pub rating: Rating,
    /// The outcome head's risk, which the rating replaced.
    pub model_risk: f64,
    /// Whether the model's risk would have chosen another profile.
    pub changed: bool,
}

// === impl Rating ===

impl Rating {
    /// The rating `digit` (0..=9), if it is one.
    pub fn new(digit: u8) -> Option<Self> {
        (digit <= 9).then_some(Self(digit))
    }

    /// The rating in a completion's text: its first non-blank character, when a digit.
    pub fn parse(text: &str) -> Option<Self> {
        let first = text.trim_start().chars().next()?;
        Self::new(u8::try_from(first.to_digit(10)?).ok()?)
    }

    pub fn digit(self) -> u8 {
        self.0
    }

    /// The risk the rating stands for: the digit's share of the scale, so 0 is no risk and
    /// 9 the whole of it.
    pub fn risk(self) -> f64 {
        f64::from(self.0) / 9.0
    }
}

// === impl SecondOpinion ===

impl SecondOpinion {
    /// Whether a request whose outcome-head risk is `risk` is rated: its risk is known and
    /// inside the band (bounds included), and it is not a stream unless streams may wait.
    /// A pinned request, or one with its own minimum quality, is routed without the risk,
    /// so it is never rated either.
    pub fn asks(&self, risk: Option<f64>, stream: bool, routed_by_risk: bool) -> bool {
        let [low, high] = self.band;
        routed_by_risk
            && (!stream || self.streams)
            && risk.is_some_and(|r| (low..=high).contains(&r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opinion(streams: bool) -> SecondOpinion {
        SecondOpinion {
            band: [0.35, 0.65],
            profile: "cheap".into(),
            timeout_ms: 150,
            streams,
        }
    }

    #[test]
    fn only_risks_inside_the_band_are_rated() {
        let o = opinion(false);
        assert!(o.asks(Some(0.35), false, true));
        assert!(o.asks(Some(0.5), false, true));
        assert!(o.asks(Some(0.65), false, true));
        assert!(!o.asks(Some(0.34), false, true));
        assert!(!o.asks(Some(0.66), false, true));
        assert!(!o.asks(None, false, true));
        assert!(!o.asks(Some(0.5), false, false), "pinned");
    }

    #[test]
    fn streams_are_rated_only_when_allowed() {
        assert!(!opinion(false).asks(Some(0.5), true, true));
        assert!(opinion(true).asks(Some(0.5), true, true));
    }

    #[test]
    fn a_rating_is_one_digit_and_its_share_of_nine() {
        assert_eq!(Rating::parse(" 7"), Rating::new(7));
        assert_eq!(Rating::parse("3 out of 9"), Rating::new(3));
        assert_eq!(Rating::parse("seven"), None);
        assert_eq!(Rating::parse(""), None);
        assert_eq!(Rating::new(10), None);
        assert_eq!(Rating::new(0).unwrap().risk(), 0.0);
        assert_eq!(Rating::new(9).unwrap().risk(), 1.0);
        assert!((Rating::new(3).unwrap().risk() - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn the_set_check_names_what_is_wrong_with_a_second_opinion() {
        let check = |opinion: &str| {
            let mut set: serde_json::Value =
                serde_json::from_str(crate::DEFAULT_PROFILE_SET).unwrap();
            set["policy"]["second_opinion"] = serde_json::from_str(opinion).unwrap();
            crate::ProfileSet::from_json(&set.to_string())
                .err()
                .map(|e| e.to_string())
        };
        assert_eq!(check(r#"{"profile": "llama8b-awq"}"#), None);
        let wrong = [
            (r#"{"profile": "nope"}"#, "policy.second_opinion.profile"),
            (
                r#"{"profile": "llama8b-awq", "band": [0.7, 0.3]}"#,
                "lower bound",
            ),
            (
                r#"{"profile": "llama8b-awq", "band": [0.2, 1.5]}"#,
                "[0, 1]",
            ),
            (r#"{"profile": "llama8b-awq", "timeout_ms": 0}"#, "1..=5000"),
            (
                r#"{"profile": "llama8b-awq", "timeout_ms": 9000}"#,
                "1..=5000",
            ),
            (r#"{"profile": "llama8b-awq", "bands": [0, 1]}"#, "bands"),
        ];
        for (opinion, message) in wrong {
            let error = check(opinion).unwrap_or_default();
            assert!(error.contains(message), "{opinion}: {error}");
        }
    }
}
