//! What gets sent: prompts, the request bodies built from them, and which requests stream.
//!
//! Bodies are serialized once before the run; per request the client only picks one and
//! clones a reference-counted [`Bytes`].

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use bytes::Bytes;
use serde_json::json;

use crate::schedule::{mix64, unit_interval};

/// Used when no prompt file is given and the repository's prompt mix is not present.
pub const BUILTIN_PROMPT: &str = "Say hello.";

/// The repository's prompt mix, relative to its root.
const PROMPT_MIX: &str = "eval/prompt-mix.jsonl";

/// Which OpenAI API the requests target.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/chat/completions` with `messages`.
    Chat,
    /// `POST /v1/completions` with `prompt`.
    Completions,
}

/// Pre-serialized request bodies, indexed by request number.
#[derive(Debug, Clone)]
pub struct Workload {
    /// `plain[choice][prompt]`, one list per `max_tokens` choice of the mix.
    plain: Vec<Vec<Bytes>>,
    streamed: Vec<Vec<Bytes>>,
    stream_share: f64,
    tokens: TokenMix,
}

/// What the body builder needs besides the prompt.
#[derive(Debug, Clone)]
pub struct BodyParams<'a> {
    /// API shape.
    pub endpoint: Endpoint,
    /// `model` field (`auto` lets the router choose).
    pub model: &'a str,
    /// `max_tokens` field.
    pub max_tokens: u32,
    /// Send vLLM's `ignore_eos`, so that every answer runs to `max_tokens`.
    pub ignore_eos: bool,
}

/// A weighted choice of `max_tokens` values, written `16` (always 16) or
/// `16:60,64:30,256:10` (16 with weight 60, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMix {
    choices: Vec<(u32, u32)>,
    total_weight: u64,
}

// === impl TokenMix ===

impl TokenMix {
    /// Always `max_tokens`.
    pub fn fixed(max_tokens: u32) -> Self {
        Self {
            choices: vec![(max_tokens, 1)],
            total_weight: 1,
        }
    }

    /// Parses `N` or `N:W,N:W,...`; every `N` and the weights' sum must be positive.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut choices = Vec::new();
        for part in text.split(',').map(str::trim) {
            let (tokens, weight) = match part.split_once(':') {
                Some((tokens, weight)) => (tokens.trim(), weight.trim()),
                None => (part, "1"),
            };
            let tokens: u32 = tokens
                .parse()
                .with_context(|| format!("max_tokens {tokens:?} in {text:?} is not a number"))?;
            let weight: u32 = weight
                .parse()
                .with_context(|| format!("weight {weight:?} in {text:?} is not a number"))?;
            anyhow::ensure!(tokens > 0, "max_tokens must be at least 1 in {text:?}");
            choices.push((tokens, weight));
        }
        let total_weight = choices.iter().map(|(_, w)| u64::from(*w)).sum();
        anyhow::ensure!(total_weight > 0, "the weights in {text:?} add up to 0");
        Ok(Self {
            choices,
            total_weight,
        })
    }

    /// The `max_tokens` values, in the order given.
    pub fn values(&self) -> impl Iterator<Item = u32> + '_ {
        self.choices.iter().map(|(tokens, _)| *tokens)
    }

    /// Weighted mean of `max_tokens`.
    pub fn mean(&self) -> f64 {
        let sum: u64 = self
            .choices
            .iter()
            .map(|(tokens, weight)| u64::from(*tokens) * u64::from(*weight))
            .sum();
        sum as f64 / self.total_weight as f64
    }

    /// Index of the choice for request `index`: a hash of the index, so the choice lines up
    /// with neither the prompt order nor the stream choice.
    pub fn pick(&self, index: u64) -> usize {
        let point =
            (unit_interval(mix64(index ^ TOKEN_MIX_SALT)) * self.total_weight as f64) as u64;
        let mut upto = 0;
        for (position, (_, weight)) in self.choices.iter().enumerate() {
            upto += u64::from(*weight);
            if point < upto {
                return position;
            }
        }
        self.choices.len().saturating_sub(1)
    }
}

impl std::fmt::Display for TokenMix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let [(tokens, _)] = self.choices.as_slice() {
            return write!(f, "{tokens}");
        }
        let parts: Vec<String> = self
            .choices
            .iter()
            .map(|(tokens, weight)| format!("{tokens}:{weight}"))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Decorrelates the `max_tokens` choice from the stream choice, which hashes the bare index.
const TOKEN_MIX_SALT: u64 = 0x5DEE_CE66_D1CE_5EED;

// === impl Endpoint ===

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completions => "/v1/completions",
        }
    }

    /// Lower-case name, as on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::Completions => "completions",
        }
    }
}

// === impl Workload ===

impl Workload {
    /// Serializes every prompt once with `params.max_tokens`, in the variants
    /// `stream_share` needs.
    pub fn prepare(
        prompts: &[String],
        params: &BodyParams<'_>,
        stream_share: f64,
    ) -> anyhow::Result<Self> {
        Self::prepare_mix(
            prompts,
            params,
            stream_share,
            &TokenMix::fixed(params.max_tokens),
        )
    }

    /// Serializes every prompt once per `max_tokens` value of `tokens` (which overrides
    /// `params.max_tokens`), in the variants `stream_share` needs.
    pub fn prepare_mix(
        prompts: &[String],
        params: &BodyParams<'_>,
        stream_share: f64,
        tokens: &TokenMix,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!prompts.is_empty(), "no prompts to send");
        anyhow::ensure!(
            (0.0..=1.0).contains(&stream_share),
            "--stream-share must be within 0.0..=1.0, got {stream_share}"
        );
        let variant = |stream: bool| -> anyhow::Result<Vec<Vec<Bytes>>> {
            tokens
                .values()
                .map(|max_tokens| {
                    let params = BodyParams {
                        max_tokens,
                        ..params.clone()
                    };
                    prompts
                        .iter()
                        .map(|prompt| Ok(Bytes::from(request_body(prompt, &params, stream)?)))
                        .collect()
                })
                .collect()
        };
        let plain = if stream_share < 1.0 {
            variant(false)?
        } else {
            Vec::new()
        };
        let streamed = if stream_share > 0.0 {
            variant(true)?
        } else {
            Vec::new()
        };
        Ok(Self {
            plain,
            streamed,
            stream_share,
            tokens: tokens.clone(),
        })
    }

    /// Body for request `index` and whether it streams. Prompts go round-robin; the stream
    /// and `max_tokens` choices are hashes of the index so they do not line up with the
    /// prompt order.
    pub fn request(&self, index: u64) -> (Bytes, bool) {
        let stream = is_streamed(index, self.stream_share);
        let variants = if stream { &self.streamed } else { &self.plain };
        // `prepare` fills every variant the share and the mix can select; the fallbacks keep
        // an empty list (impossible) from panicking.
        let Some(bodies) = variants.get(self.tokens.pick(index)) else {
            return (Bytes::new(), stream);
        };
        let len = bodies.len().max(1) as u64;
        let body = bodies
            .get((index % len) as usize)
            .cloned()
            .unwrap_or_default();
        (body, stream)
    }
}

/// Whether request `index` streams, given the share of streamed requests.
pub fn is_streamed(index: u64, share: f64) -> bool {
    unit_interval(mix64(index)) < share
}

/// The JSON body of one request.
pub fn request_body(
    prompt: &str,
    params: &BodyParams<'_>,
    stream: bool,
) -> anyhow::Result<Vec<u8>> {
    let mut body = match params.endpoint {
        Endpoint::Chat => json!({
            "model": params.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": params.max_tokens,
            "stream": stream,
        }),
        Endpoint::Completions => json!({
            "model": params.model,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "stream": stream,
        }),
    };
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if params.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    Ok(serde_json::to_vec(&body)?)
}

/// Reads a JSONL file whose lines carry a `"prompt"` string; blank lines are skipped.
pub fn load_prompts(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read prompts from {}", path.display()))?;
    parse_prompts(&text).with_context(|| format!("in {}", path.display()))
}

/// Parses JSONL prompt lines (see [`load_prompts`]).
pub fn parse_prompts(text: &str) -> anyhow::Result<Vec<String>> {
    let mut prompts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("line {}: not JSON", number + 1))?;
        let prompt = value
            .get("prompt")
            .and_then(serde_json::Value::as_str)
            .with_context(|| format!("line {}: no string field \"prompt\"", number + 1))?;
        prompts.push(prompt.to_owned());
    }
    anyhow::ensure!(!prompts.is_empty(), "no prompts found");
    Ok(prompts)
}

/// The repository's prompt mix if it can be found from the working directory (the repository root)
/// or from this crate's source location.
pub fn default_prompts_path() -> Option<PathBuf> {
    let from_cwd = PathBuf::from(PROMPT_MIX);
    let from_crate = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(PROMPT_MIX);
    [from_cwd, from_crate]
        .into_iter()
        .find(|path| path.is_file())
}

/// Loads `path`, else the repository's mix, else the built-in prompt. Returns where they came from.
pub fn resolve_prompts(path: Option<&Path>) -> anyhow::Result<(Vec<String>, String)> {
    if let Some(path) = path {
        return Ok((load_prompts(path)?, path.display().to_string()));
    }
    match default_prompts_path() {
        Some(path) => Ok((load_prompts(&path)?, path.display().to_string())),
        None => Ok((vec![BUILTIN_PROMPT.to_owned()], "built-in".to_owned())),
    }
}

/// Reorders prompts reproducibly (Fisher–Yates driven by [`mix64`]).
pub fn shuffle(prompts: &mut [String], seed: u64) {
    let mut state = seed;
    for upper in (1..prompts.len()).rev() {
        state = mix64(state);
        let pick = (state % (upper as u64 + 1)) as usize;
        prompts.swap(upper, pick);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: BodyParams<'static> = BodyParams {
        endpoint: Endpoint::Chat,
        model: "auto",
        max_tokens: 16,
        ignore_eos: false,
    };

    #[test]
    fn chat_body_has_messages_and_asks_for_usage_when_streaming() {
        let body: serde_json::Value =
            serde_json::from_slice(&request_body("hi", &PARAMS, true).unwrap()).unwrap();
        assert_eq!(
            body,
            json!({"model": "auto", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 16, "stream": true, "stream_options": {"include_usage": true}})
        );
        let plain: serde_json::Value =
            serde_json::from_slice(&request_body("hi", &PARAMS, false).unwrap()).unwrap();
        assert!(plain.get("stream_options").is_none());
        assert!(plain.get("ignore_eos").is_none());
    }

    #[test]
    fn ignore_eos_is_sent_when_asked() {
        let params = BodyParams {
            ignore_eos: true,
            ..PARAMS
        };
        let body: serde_json::Value =
            serde_json::from_slice(&request_body("hi", &params, true).unwrap()).unwrap();
        assert_eq!(body["ignore_eos"], true);
    }

    #[test]
    fn completions_body_has_prompt() {
        let params = BodyParams {
            endpoint: Endpoint::Completions,
            ..PARAMS
        };
        let body: serde_json::Value =
            serde_json::from_slice(&request_body("hi", &params, false).unwrap()).unwrap();
        assert_eq!(body["prompt"], "hi");
        assert_eq!(Endpoint::Completions.path(), "/v1/completions");
    }

    #[test]
    fn prompts_go_round_robin() {
        let prompts = vec!["a".to_owned(), "b".to_owned()];
        let workload = Workload::prepare(&prompts, &PARAMS, 0.0).unwrap();
        let content = |index| {
            let (body, stream) = workload.request(index);
            assert!(!stream);
            let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
            value["messages"][0]["content"].as_str().unwrap().to_owned()
        };
        assert_eq!([content(0), content(1), content(2)], ["a", "b", "a"]);
    }

    #[test]
    fn stream_share_selects_about_that_fraction() {
        assert!((0..1000).all(|i| is_streamed(i, 1.0)));
        assert!((0..1000).all(|i| !is_streamed(i, 0.0)));
        let streamed = (0..10_000).filter(|&i| is_streamed(i, 0.3)).count();
        assert!((2700..3300).contains(&streamed), "{streamed}");
    }

    #[test]
    fn parses_jsonl_and_names_the_bad_line() {
        let prompts = parse_prompts("{\"prompt\":\"x\",\"id\":1}\n\n{\"prompt\":\"y\"}\n").unwrap();
        assert_eq!(prompts, ["x", "y"]);
        let error = parse_prompts("{\"prompt\":\"x\"}\n{\"id\":2}\n").unwrap_err();
        assert!(format!("{error:#}").contains("line 2"), "{error:#}");
        assert!(parse_prompts("\n").is_err());
    }

    #[test]
    fn shuffle_is_a_reproducible_permutation() {
        let original: Vec<String> = (0..20).map(|i| i.to_string()).collect();
        let mut first = original.clone();
        let mut second = original.clone();
        shuffle(&mut first, 7);
        shuffle(&mut second, 7);
        assert_eq!(first, second);
        assert_ne!(first, original);
        first.sort_by_key(|s| s.parse::<u32>().unwrap());
        assert_eq!(first, original);
    }

    #[test]
    fn token_mix_parses_single_values_and_weighted_lists() {
        assert_eq!(TokenMix::parse("16").unwrap(), TokenMix::fixed(16));
        let mix = TokenMix::parse("16:60, 64:30,256:10").unwrap();
        assert_eq!(mix.values().collect::<Vec<_>>(), [16, 64, 256]);
        assert!((mix.mean() - (16.0 * 0.6 + 64.0 * 0.3 + 25.6)).abs() < 1e-9);
        assert_eq!(mix.to_string(), "16:60,64:30,256:10");
        assert_eq!(TokenMix::fixed(16).to_string(), "16");
        for bad in ["", "0", "16:x", "x:1", "16:0", "16:1,,32:1", "-4:1"] {
            assert!(TokenMix::parse(bad).is_err(), "{bad:?}");
        }
        // A zero weight is allowed as long as another is positive; it is never picked.
        let never_64 = TokenMix::parse("16:1,64:0").unwrap();
        assert!((0..1000).all(|i| never_64.pick(i) == 0));
    }

    #[test]
    fn token_mix_picks_in_proportion_to_the_weights() {
        let mix = TokenMix::parse("16:60,64:30,256:10").unwrap();
        let mut counts = [0usize; 3];
        for index in 0..10_000 {
            counts[mix.pick(index)] += 1;
        }
        assert!((5700..6300).contains(&counts[0]), "{counts:?}");
        assert!((2700..3300).contains(&counts[1]), "{counts:?}");
        assert!((800..1200).contains(&counts[2]), "{counts:?}");
    }

    #[test]
    fn request_bodies_carry_the_picked_max_tokens() {
        let mix = TokenMix::parse("16:1,64:1").unwrap();
        let workload = Workload::prepare_mix(&["a".to_owned()], &PARAMS, 0.5, &mix).unwrap();
        for index in 0..200 {
            let (body, stream) = workload.request(index);
            let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let expected = [16, 64][mix.pick(index)];
            assert_eq!(value["max_tokens"], expected);
            assert_eq!(value["stream"], stream);
        }
    }

    #[test]
    fn rejects_out_of_range_stream_share() {
        assert!(Workload::prepare(&["a".to_owned()], &PARAMS, 1.5).is_err());
    }
}
