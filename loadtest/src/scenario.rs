//! Named load presets for the benchmark suite (`loadtest suite`, run by `scripts/bench`): what
//! each scenario sends.
//!
//! A preset fixes the shape of the requests (stream share, `max_tokens` mix, whether answers
//! are checked); the rate or concurrency, the duration and the target come from the command
//! line, because they depend on the machine and on which server is being driven. Flags given
//! explicitly win over the preset.

use std::str::FromStr;

use crate::workload::TokenMix;

/// The scenarios of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Zero-latency upstream: the router's own cost, non-streamed (`--stream-share 1` for
    /// streams).
    Overhead,
    /// Three tiers with realistic latency, the prompt mix, 10% streamed.
    Mixed,
    /// Far more load than the tier admits: 429s with `Retry-After`.
    Overload,
    /// Steady load while endpoints die, fail, hang and profiles change: every answer checked.
    Chaos,
    /// Many long streams held open at once.
    Soak,
}

/// What a scenario sends.
#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    /// Share of streamed requests.
    pub stream_share: f64,
    /// `max_tokens` mix.
    pub max_tokens: TokenMix,
    /// Check that every 200 is a completion (error bodies are always checked).
    pub check_answers: bool,
    /// Ask for answers of exactly `max_tokens` (vLLM's `ignore_eos`).
    pub ignore_eos: bool,
}

// === impl Scenario ===

impl Scenario {
    /// Every scenario, in the order the suite runs them.
    pub const ALL: [Self; 5] = [
        Self::Overhead,
        Self::Mixed,
        Self::Overload,
        Self::Chaos,
        Self::Soak,
    ];

    /// The name used on the command line and in result file names.
    pub fn name(self) -> &'static str {
        match self {
            Self::Overhead => "overhead",
            Self::Mixed => "mixed",
            Self::Overload => "overload",
            Self::Chaos => "chaos",
            Self::Soak => "soak",
        }
    }

    /// The request shape of this scenario.
    pub fn preset(self) -> Preset {
        // Each mix is a literal checked by a test, so a parse failure cannot happen; the
        // fallback keeps the function total anyway.
        let mix = |text: &str, fallback: u32| {
            TokenMix::parse(text).unwrap_or_else(|_| TokenMix::fixed(fallback))
        };
        match self {
            // Short answers: the upstream costs nothing, so the router's cost is what shows.
            Self::Overhead => Preset {
                stream_share: 0.0,
                max_tokens: TokenMix::fixed(16),
                check_answers: false,
                ignore_eos: false,
            },
            // Mostly short chat answers with a tail of long ones, as in a chat product.
            Self::Mixed => Preset {
                stream_share: 0.1,
                max_tokens: mix(MIXED_TOKENS, 64),
                check_answers: false,
                ignore_eos: false,
            },
            // One size, so the tier's capacity in requests/s is a known number.
            Self::Overload => Preset {
                stream_share: 0.0,
                max_tokens: TokenMix::fixed(32),
                check_answers: true,
                ignore_eos: false,
            },
            // Streams as well, because a failure mid-stream must still end in one answer.
            Self::Chaos => Preset {
                stream_share: 0.2,
                max_tokens: mix(CHAOS_TOKENS, 32),
                check_answers: true,
                ignore_eos: false,
            },
            // Long streams: with the simulator's inter-token latency they outlast the window,
            // and `ignore_eos` keeps each one open until all its tokens are out.
            Self::Soak => Preset {
                stream_share: 1.0,
                max_tokens: TokenMix::fixed(SOAK_TOKENS),
                check_answers: false,
                ignore_eos: true,
            },
        }
    }
}

impl FromStr for Scenario {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|scenario| scenario.name() == text)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|s| s.name()).collect();
                anyhow::anyhow!("unknown scenario {text:?}; one of {}", names.join(", "))
            })
    }
}

/// `max_tokens` of the `mixed` scenario.
pub const MIXED_TOKENS: &str = "16:50,64:30,256:20";
/// `max_tokens` of the `chaos` scenario.
pub const CHAOS_TOKENS: &str = "16:70,64:30";
/// `max_tokens` of every `soak` stream.
pub const SOAK_TOKENS: u32 = 300;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for scenario in Scenario::ALL {
            assert_eq!(scenario.name().parse::<Scenario>().unwrap(), scenario);
        }
        let error = "overheat".parse::<Scenario>().unwrap_err().to_string();
        assert!(
            error.contains("overhead, mixed, overload, chaos, soak"),
            "{error}"
        );
    }

    #[test]
    fn presets_have_the_documented_shapes() {
        assert_eq!(Scenario::Overhead.preset().stream_share, 0.0);
        let mixed = Scenario::Mixed.preset();
        assert_eq!(mixed.stream_share, 0.1);
        assert_eq!(mixed.max_tokens, TokenMix::parse(MIXED_TOKENS).unwrap());
        assert_eq!(
            Scenario::Chaos.preset().max_tokens,
            TokenMix::parse(CHAOS_TOKENS).unwrap()
        );
        assert!(Scenario::Chaos.preset().check_answers);
        assert!(Scenario::Overload.preset().check_answers);
        assert_eq!(Scenario::Soak.preset().stream_share, 1.0);
        assert!(Scenario::Soak.preset().ignore_eos);
    }
}
