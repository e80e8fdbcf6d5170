//! The process-wide TLS setup shared by every rustls user (Redis `rediss://`, and the
//! Kubernetes client).

use std::sync::Once;

/// Installs ring as rustls's crypto provider, once. Idempotent and cheap, so every code
/// path that may open a TLS connection calls it first instead of relying on start-up order.
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Err means another provider was installed first (by a test or an embedding
        // program); any provider will do.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
