//! The workload both policy benchmarks measure: one request's features + decision.

use quantrouter_policy::{
    decide, score, Classifier, Overrides, ProfileSet, Prompt, Role, RouteRequest, RoutingDecision,
    Segment,
};

/// A prompt of about `len` bytes mixing prose, numbers and a little code.
pub fn prompt_of(len: usize) -> String {
    let unit = "Summarise the quarterly report: revenue grew 12% to $4.2M while costs fell. \
                Then write a Python function `def growth(a, b): return (b - a) / a` and explain it. ";
    unit.repeat(len / unit.len() + 1)[..len].to_owned()
}

/// What the router does per request: extract features, classify (unless `classifier` is
/// `None`, the structural score alone), then decide.
pub fn route(set: &ProfileSet, classifier: Option<&Classifier>, text: &str) -> RoutingDecision {
    let prompt = Prompt {
        segments: vec![Segment {
            role: Role::User,
            text,
        }],
        wants_json: false,
    };
    let (features, _) = score(&prompt, &set.policy.complexity, classifier);
    let req = RouteRequest {
        features: &features,
        max_tokens: Some(256),
        overrides: Overrides::default(),
        routing_key: "bench",
    };
    decide(set, &req, &[]).unwrap()
}
