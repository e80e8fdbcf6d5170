//! An upstream's bearer token (`upstream.api_key_env` / `upstream.api_key_file`), read from
//! the router's environment or a mounted Secret, never from the profile document.
//!
//! The token only ever exists as a sensitive `HeaderValue` (its `Debug` prints `Sensitive`),
//! is sent as `Authorization: Bearer …` on requests, scrapes and health checks to that
//! upstream, and is never logged: log lines name where it comes from, not what it is.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use http::HeaderValue;
use quantrouter_policy::ApiKeySource;

/// Where a profile's token lives, and the header it makes.
#[derive(Debug)]
pub struct Credential {
    source: Source,
    header: ArcSwapOption<HeaderValue>,
    /// The last read failed; warnings are logged on a change, not every scrape.
    missing: AtomicBool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Env(String),
    File(PathBuf),
}

// === impl Credential ===

impl Credential {
    /// Reads the token once now; [`Credential::refresh`] reads it again.
    pub fn new(source: ApiKeySource<'_>) -> Arc<Self> {
        let source = match source {
            ApiKeySource::Env(var) => Source::Env(var.to_owned()),
            ApiKeySource::File(path) => Source::File(PathBuf::from(path)),
        };
        let credential = Arc::new(Self {
            source,
            header: ArcSwapOption::empty(),
            missing: AtomicBool::new(false),
        });
        credential.refresh();
        credential
    }

    /// The `Authorization` value, if the token could be read.
    pub fn header(&self) -> Option<HeaderValue> {
        self.header.load().as_deref().cloned()
    }

    /// Reads the token again, so a rotated Secret (the kubelet updates mounted files in
    /// place) is used without a restart. A token that cannot be read leaves the upstream
    /// without one: it answers 401, which the operator sees, rather than the router refusing
    /// to start or keep the rest of the profile set.
    pub fn refresh(&self) {
        match self.read() {
            Ok(header) => {
                if self.missing.swap(false, Ordering::Relaxed) {
                    tracing::info!(source = %self.describe(), "upstream API key available again");
                }
                self.header.store(Some(Arc::new(header)));
            }
            Err(why) => {
                if !self.missing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(source = %self.describe(), why,
                        "upstream API key unavailable; requests go without it");
                }
                self.header.store(None);
            }
        }
    }

    fn read(&self) -> Result<HeaderValue, &'static str> {
        let token = match &self.source {
            Source::Env(var) => std::env::var(var).map_err(|_| "the variable is not set")?,
            Source::File(path) => {
                std::fs::read_to_string(path).map_err(|_| "the file cannot be read")?
            }
        };
        bearer(token.trim())
    }

    /// Where the token comes from, for log lines.
    fn describe(&self) -> String {
        match &self.source {
            Source::Env(var) => format!("env {var}"),
            Source::File(path) => format!("file {}", path.display()),
        }
    }
}

/// `Bearer <token>`, marked sensitive.
fn bearer(token: &str) -> Result<HeaderValue, &'static str> {
    if token.is_empty() {
        return Err("the key is empty");
    }
    let mut value = HeaderValue::try_from(format!("Bearer {token}"))
        .map_err(|_| "the key has characters a header cannot carry")?;
    value.set_sensitive(true);
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_key_is_trimmed_sensitive_and_reread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "sk-one\n").unwrap();
        let credential = Credential::new(ApiKeySource::File(path.to_str().unwrap()));
        let header = credential.header().unwrap();
        assert_eq!(header, "Bearer sk-one");
        assert!(header.is_sensitive());
        assert!(!format!("{credential:?}").contains("sk-one"));

        std::fs::write(&path, "sk-two").unwrap();
        credential.refresh();
        assert_eq!(credential.header().unwrap(), "Bearer sk-two");

        std::fs::remove_file(&path).unwrap();
        credential.refresh();
        assert_eq!(credential.header(), None);
        std::fs::write(&path, "bad\nkey").unwrap();
        credential.refresh();
        assert_eq!(
            credential.header(),
            None,
            "a newline inside is not a header value"
        );
    }
}
