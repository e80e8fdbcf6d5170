//! The error every command returns, and its exit code.

/// A failed command and its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad input: exit 1.
    #[error("{0}")]
    Invalid(String),
    /// Could not reach or run something: exit 2.
    #[error("{0}")]
    Io(String),
    /// Another operator changed the active set first: exit 3.
    #[error("{0}")]
    Conflict(String),
}
