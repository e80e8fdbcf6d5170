//! Checks for quantrouter's Kubernetes packaging (the Helm chart, the kustomize manifests,
//! the KEDA examples and the monitoring files). Everything is in `tests/`; this library is
//! empty so that `cargo test -p quantrouter-deploy-check` has a crate to attach them to.
