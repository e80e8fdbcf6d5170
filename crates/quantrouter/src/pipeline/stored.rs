//! Stored Responses in the pipeline: a follow-up (`previous_response_id`) is pinned to the
//! profile that stored the response it continues, and a native Responses answer is placed
//! on the profile that stored it, whichever door it came through.

use std::sync::Arc;

use bytes::BytesMut;
use http::{HeaderMap, HeaderValue};
use serde_json::Value;

use crate::apis::relay::{stored_id, MAX_WHOLE};
use crate::apis::stored::Stored;
use crate::app::App;
use crate::openai::ApiError;
use crate::routing::PROFILE_HEADER;
use crate::upstream::sse::{data_of, EventBuffer};

/// A follow-up is pinned to the profile that stored the response it continues; one the
/// router cannot place, or another tenant's (`tenant` is the caller's id), is refused, not
/// sent where it would fail or read what is not the caller's.
pub(super) async fn place_follow_up(
    app: &App,
    headers: &mut HeaderMap,
    previous: &str,
    tenant: Option<&str>,
) -> Result<(), ApiError> {
    let profile = app
        .responses
        .profile_of(previous, tenant)
        .await
        .ok_or_else(|| ApiError::ResponseNotFound(previous.to_owned()))?;
    let value = HeaderValue::from_str(&profile)
        .map_err(|_| ApiError::ResponseNotFound(previous.to_owned()))?;
    headers.insert(PROFILE_HEADER, value);
    Ok(())
}

/// Remembers which profile stored a native Responses answer — the one its router headers
/// name — and for which tenant (`None` without tenants), when called with the answer's id
/// (as `crate::apis::relay::OnStored`).
pub(crate) fn on_stored(
    app: &App,
    headers: &HeaderMap,
    tenant: Option<String>,
) -> Option<Box<dyn FnOnce(String) + Send + Sync>> {
    let profile = headers.get(PROFILE_HEADER)?.to_str().ok()?.to_owned();
    let store = Arc::clone(&app.responses);
    Some(Box::new(move |id| {
        store.remember(id, Stored { profile, tenant })
    }))
}

/// Watches a native Responses answer pass, for a door that relays it without reading it
/// whole (the endpoint picker): the stored answer's id, from the `response.completed`
/// event of a stream or from a whole answer, is placed as [`on_stored`] says.
pub(crate) struct StoredWatch {
    on_stored: Option<Box<dyn FnOnce(String) + Send + Sync>>,
    sse: bool,
    events: EventBuffer,
    whole: BytesMut,
}

impl StoredWatch {
    pub(crate) fn new(on_stored: Box<dyn FnOnce(String) + Send + Sync>, sse: bool) -> Self {
        Self {
            on_stored: Some(on_stored),
            sse,
            events: EventBuffer::default(),
            whole: BytesMut::new(),
        }
    }

    /// A piece of the answer.
    pub(crate) fn feed(&mut self, chunk: &[u8]) {
        if self.on_stored.is_none() {
            return;
        }
        if !self.sse {
            // Past the relay's bound the HTTP port passes the answer untranslated and
            // unplaced too.
            if self.whole.len() + chunk.len() <= MAX_WHOLE {
                self.whole.extend_from_slice(chunk);
            }
            return;
        }
        self.events.push(chunk);
        while let Some(event) = self.events.next_event() {
            const COMPLETED: &[u8] = b"response.completed";
            if !event.windows(COMPLETED.len()).any(|w| w == COMPLETED) {
                continue;
            }
            let Some(data) = data_of(&event) else {
                continue;
            };
            if let Ok(value) = serde_json::from_slice::<Value>(&data) {
                self.place(&value["response"]);
            }
        }
    }

    /// The answer ended.
    pub(crate) fn finish(&mut self) {
        if self.sse || self.on_stored.is_none() {
            return;
        }
        if let Ok(value) = serde_json::from_slice::<Value>(&self.whole) {
            self.place(&value);
        }
    }

    fn place(&mut self, response: &Value) {
        if let (Some(id), Some(on_stored)) = (stored_id(response), self.on_stored.take()) {
            on_stored(id.to_owned());
        }
    }
}
