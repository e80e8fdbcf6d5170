//! Stored Responses in the pipeline: a follow-up (`previous_response_id`) is pinned to the
//! profile that stored the response it continues, and a native Responses answer is placed
//! on the profile that stored it, whichever door it came through.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue};

use crate::app::App;
use crate::openai::ApiError;
use crate::routing::PROFILE_HEADER;

/// A follow-up is pinned to the profile that stored the response it continues; one the
/// router cannot place is refused, not sent where it would fail.
pub(super) async fn place_follow_up(
    app: &App,
    headers: &mut HeaderMap,
    previous: &str,
) -> Result<(), ApiError> {
    let profile = app
        .responses
        .profile_of(previous)
        .await
        .ok_or_else(|| ApiError::ResponseNotFound(previous.to_owned()))?;
    let value = HeaderValue::from_str(&profile)
        .map_err(|_| ApiError::ResponseNotFound(previous.to_owned()))?;
    headers.insert(PROFILE_HEADER, value);
    Ok(())
}

/// Remembers which profile stored a native Responses answer — the one its router headers
/// name — when called with the answer's id (as `crate::apis::relay::OnStored`).
pub(crate) fn on_stored(
    app: &App,
    headers: &HeaderMap,
) -> Option<Box<dyn FnOnce(String) + Send + Sync>> {
    let profile = headers.get(PROFILE_HEADER)?.to_str().ok()?.to_owned();
    let store = Arc::clone(&app.responses);
    Some(Box::new(move |id| store.remember(id, profile)))
}
