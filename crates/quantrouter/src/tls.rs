//! TLS set-up shared by every client that speaks TLS (the Kubernetes API today).

/// Installs rustls's `ring` provider as the process-wide default, once; later calls (and a
/// provider installed by someone else first) are fine.
///
/// rustls picks a provider from its crate features only while exactly one is compiled in;
/// installing it explicitly keeps working if a dependency ever enables a second one.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is all we need.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
