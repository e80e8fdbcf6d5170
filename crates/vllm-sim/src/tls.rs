//! HTTPS for the simulator (`--tls-cert/--tls-key`): rustls on ring, offering HTTP/2 and
//! HTTP/1.1 by ALPN, so tests can put an `https://` upstream behind the router.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// Why a certificate and key do not make a TLS server.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the certificate PEM: {0}")]
    Certificate(rustls::pki_types::pem::Error),
    #[error("the certificate PEM holds no certificate")]
    NoCertificate,
    #[error("the key PEM: {0}")]
    Key(rustls::pki_types::pem::Error),
    #[error("TLS: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A TLS server configuration from a PEM certificate chain (leaf first) and its PEM private
/// key.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(TlsError::Certificate)?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(TlsError::Key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
