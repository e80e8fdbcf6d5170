//! The seed write-ups' profile list (`model_profiles:active`), converted into a [`ProfileSet`].
//!
//! The list carries no endpoints, so the router's configuration supplies a map from
//! `model_id` to base URL. Every listed model needs an endpoint and every endpoint must name
//! a listed model: a typo on either side is an error, not a silently dropped profile.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::profile::{
    parse_with_path, FieldError, Latency, Policy, Profile, ProfileSet, ProfileSetError, Quality,
    StaticUpstream, Upstream, ValidationErrors,
};

/// One entry of the seed list format.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeedProfile {
    pub model_id: String,
    pub quantization: String,
    pub cost_per_1m_tokens: f64,
    pub predicted_latency_ms: f64,
    pub accuracy_score: f64,
    #[serde(default)]
    pub min_gpu_vram_gb: Option<f64>,
}

/// Context assumed for seed profiles, which do not state one: Llama-3.1 deployments are
/// commonly served with `--max-model-len 8192`.
const SEED_CONTEXT_TOKENS: u32 = 8192;
/// Share of the seed's single latency figure attributed to time-to-first-token.
const SEED_TTFT_SHARE: f64 = 0.1;

/// Converts a seed list (JSON array) into a validated profile set.
///
/// The seed's one latency figure is read as the latency of a typical answer
/// (`policy.expected_output_tokens`): 10% of it to the first token, the rest spread over the
/// tokens. The most accurate model becomes `default_profile`.
pub fn from_seed_list(
    text: &str,
    endpoints: &BTreeMap<String, String>,
    version: u64,
) -> Result<ProfileSet, ProfileSetError> {
    let seeds: Vec<SeedProfile> = parse_with_path(text)?;
    let policy = Policy::default();
    let mut errors = Vec::new();
    for model in endpoints.keys() {
        if !seeds.iter().any(|s| &s.model_id == model) {
            errors.push(FieldError {
                path: format!("endpoints.{model}"),
                message: "names a model that is not in the seed list".into(),
            });
        }
    }
    let out_tokens = f64::from(policy.expected_output_tokens);
    let profiles: Vec<Profile> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let url = endpoints.get(&s.model_id).cloned();
            if url.is_none() {
                errors.push(FieldError {
                    path: format!("[{i}].model_id"),
                    message: format!("no endpoint configured for `{}`", s.model_id),
                });
            }
            Profile {
                id: s.model_id.clone(),
                model: s.model_id.clone(),
                quantization: s.quantization.clone(),
                tier: s.quantization.to_ascii_lowercase(),
                upstream: Upstream::Static(StaticUpstream::new(url.into_iter().collect())),
                cost_per_1m_input_tokens: s.cost_per_1m_tokens,
                cost_per_1m_output_tokens: s.cost_per_1m_tokens,
                latency: Latency {
                    ttft_ms: s.predicted_latency_ms * SEED_TTFT_SHARE,
                    itl_ms: s.predicted_latency_ms * (1.0 - SEED_TTFT_SHARE) / out_tokens,
                },
                quality: Quality {
                    default: s.accuracy_score,
                    code: None,
                    math: None,
                    structured: None,
                    reasoning: None,
                },
                max_context_tokens: SEED_CONTEXT_TOKENS,
                max_concurrency: 256,
                chars_per_token: 4.0,
                cold_start_timeout_ms: 0,
                enabled: true,
            }
        })
        .collect();
    if !errors.is_empty() {
        return Err(ProfileSetError::Invalid(ValidationErrors(errors)));
    }
    let default_profile = profiles
        .iter()
        .max_by(|a, b| a.quality.default.total_cmp(&b.quality.default))
        .map(|p| p.id.clone())
        .unwrap_or_default();
    let set = ProfileSet {
        version,
        updated_at: None,
        default_profile,
        policy,
        profiles,
    };
    set.validate().map_err(ProfileSetError::Invalid)?;
    Ok(set)
}

/// True when the document is a JSON array, i.e. the seed list format.
pub fn looks_like_seed_list(text: &str) -> bool {
    text.trim_start().starts_with('[')
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEEDS: &str = r#"[
      {"model_id": "llama-8b-int4", "quantization": "AWQ", "cost_per_1m_tokens": 0.05,
       "predicted_latency_ms": 400, "accuracy_score": 0.86, "min_gpu_vram_gb": 8},
      {"model_id": "llama-70b-fp8", "quantization": "FP8", "cost_per_1m_tokens": 0.9,
       "predicted_latency_ms": 1500, "accuracy_score": 0.95, "min_gpu_vram_gb": 80}
    ]"#;

    fn endpoints(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn converts_seed_list_with_endpoints() {
        let map = endpoints(&[
            ("llama-8b-int4", "http://10.0.0.1:8000"),
            ("llama-70b-fp8", "http://10.0.0.2:8000"),
        ]);
        let set = from_seed_list(SEEDS, &map, 3).unwrap();
        assert_eq!(set.version, 3);
        assert_eq!(set.default_profile, "llama-70b-fp8");
        let p = set.profile("llama-8b-int4").unwrap();
        assert_eq!(p.tier, "awq");
        assert_eq!(p.quality.default, 0.86);
        assert!((p.latency.ttft_ms - 40.0).abs() < 1e-9);
        assert_eq!(p.upstream.base_urls(), vec!["http://10.0.0.1:8000"]);
    }

    #[test]
    fn missing_endpoint_is_an_error() {
        let map = endpoints(&[("llama-8b-int4", "http://10.0.0.1:8000")]);
        let err = from_seed_list(SEEDS, &map, 1).unwrap_err().to_string();
        assert!(err.contains("[1].model_id"), "{err}");
    }

    #[test]
    fn endpoint_for_unknown_model_is_an_error() {
        let map = endpoints(&[
            ("llama-8b-int4", "http://10.0.0.1:8000"),
            ("llama-70b-fp8", "http://10.0.0.2:8000"),
            ("typo", "http://10.0.0.3:8000"),
        ]);
        let err = from_seed_list(SEEDS, &map, 1).unwrap_err().to_string();
        assert!(err.contains("endpoints.typo"), "{err}");
    }

    #[test]
    fn unknown_seed_field_names_its_path() {
        let err = from_seed_list(r#"[{"model_id": "a", "bogus": 1}]"#, &BTreeMap::new(), 1)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("[0]"), "{err}");
    }
}
