//! The [`ProfileSource`] seam: where profile sets come from, and the start-up order.
//!
//! Three implementations: [`Embedded`] (the built-in default), [`FileSource`] (`--profiles`,
//! watched for edits) and `RedisSource` (`--redis-url`, in `redis_source`). Each source
//! offers a start-up document and then follows its changes into the [`ProfileStore`]; the
//! store decides what wins (see [`ProfileStore::apply`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use quantrouter_policy::{ProfileSet, DEFAULT_PROFILE_SET};
use tokio::task::JoinHandle;

use super::{ProfileStore, ReloadError, SourceKind};
use crate::telemetry::{self, ReloadResult};

/// A place profile sets come from.
pub trait ProfileSource: Send + Sync + 'static {
    /// The source's current document, if it has one; bounded in time. An error means the
    /// operator's configuration is wrong (an unreadable or invalid start-up file) and the
    /// router should not start; a source that is merely unreachable answers `Ok(None)`.
    fn load(&self) -> BoxFuture<'_, Result<Option<(ProfileSet, SourceKind)>, ReloadError>>;

    /// Applies the source's later changes to `store` until the returned task is aborted;
    /// `None` for a source that never changes.
    fn follow(self: Arc<Self>, store: Arc<ProfileStore>) -> Option<JoinHandle<()>>;
}

/// A running store with the tasks that keep it up to date.
#[derive(Debug)]
pub struct Started {
    pub store: Arc<ProfileStore>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Starts on the first source (in the given order of preference) that has a document, falling
/// back to the embedded default, then lets every source follow its changes: a preferred
/// source that was unreachable at start-up takes over as soon as it answers.
pub async fn start(sources: Vec<Arc<dyn ProfileSource>>) -> Result<Started, ReloadError> {
    let mut initial = None;
    for source in &sources {
        if let Some(found) = source.load().await? {
            initial = Some(found);
            break;
        }
    }
    let (set, kind) = match initial {
        Some(found) => found,
        None => (
            ProfileSet::from_json(DEFAULT_PROFILE_SET)?,
            SourceKind::Embedded,
        ),
    };
    tracing::info!(version = set.version, source = ?kind, "profile set loaded");
    let store = Arc::new(ProfileStore::new(set, kind));
    let tasks = sources
        .into_iter()
        .filter_map(|source| source.follow(Arc::clone(&store)))
        .collect();
    Ok(Started { store, tasks })
}

/// The set compiled into the binary (`profiles/default.json`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Embedded;

impl ProfileSource for Embedded {
    fn load(&self) -> BoxFuture<'_, Result<Option<(ProfileSet, SourceKind)>, ReloadError>> {
        Box::pin(async {
            let set = ProfileSet::from_json(DEFAULT_PROFILE_SET)?;
            Ok(Some((set, SourceKind::Embedded)))
        })
    }

    fn follow(self: Arc<Self>, _store: Arc<ProfileStore>) -> Option<JoinHandle<()>> {
        None
    }
}

/// A profile-set file, polled for edits by modification time and size (no inotify needed,
/// and it sees Kubernetes ConfigMap symlink swaps).
///
/// A file edit may keep the version number: operators editing a file by hand rarely bump
/// it, and the file is its only writer, so "not older" is enough.
#[derive(Debug, Clone)]
pub struct FileSource {
    pub path: PathBuf,
    pub interval: Duration,
}

impl ProfileSource for FileSource {
    fn load(&self) -> BoxFuture<'_, Result<Option<(ProfileSet, SourceKind)>, ReloadError>> {
        Box::pin(async { Ok(Some((read_file(&self.path)?, SourceKind::File))) })
    }

    fn follow(self: Arc<Self>, store: Arc<ProfileStore>) -> Option<JoinHandle<()>> {
        let path = self.path.clone();
        Some(crate::documents::file::watch(
            path,
            self.interval,
            move |_| self.reload(&store),
        ))
    }
}

impl FileSource {
    fn reload(&self, store: &ProfileStore) {
        let path = self.path.display();
        match read_file(&self.path).and_then(|set| store.apply(set, SourceKind::File, true)) {
            Ok(()) => {
                let version = store.load().set.version;
                tracing::info!(%path, version, "profile set reloaded");
                telemetry::profile_reload("file", ReloadResult::Applied);
            }
            Err(error @ ReloadError::Outranked { .. }) => {
                tracing::info!(%path, %error, "profile file edit not applied");
                telemetry::profile_reload("file", ReloadResult::Ignored);
            }
            Err(error) => {
                tracing::warn!(%path, %error, "profile file rejected; keeping the active set");
                telemetry::profile_reload("file", ReloadResult::Rejected);
            }
        }
    }
}

pub(super) fn read_file(path: &Path) -> Result<ProfileSet, ReloadError> {
    let text = crate::documents::read_file(path).map_err(|source| ReloadError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok(ProfileSet::from_json(&text)?)
}

/// The start-up profile set: the `--profiles` file if given, else the embedded default.
pub fn initial_set(path: Option<&Path>) -> Result<(ProfileSet, SourceKind), ReloadError> {
    match path {
        Some(path) => Ok((read_file(path)?, SourceKind::File)),
        None => Ok((
            ProfileSet::from_json(DEFAULT_PROFILE_SET)?,
            SourceKind::Embedded,
        )),
    }
}

/// A profile-set file, or a seed-format list whose `MODEL_ID`s get the endpoints of
/// `seed_endpoints` (as `profiles validate`, `profiles push` and `profile-tier` read them).
pub fn read_set_or_seed_list(
    path: &Path,
    seed_endpoints: &std::collections::BTreeMap<String, String>,
) -> Result<ProfileSet, String> {
    let text = crate::documents::read_file(path)
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    let result = if quantrouter_policy::looks_like_seed_list(&text) {
        quantrouter_policy::from_seed_list(&text, seed_endpoints, 1)
    } else {
        ProfileSet::from_json(&text)
    };
    result.map_err(|e| format!("{}:\n{e}", path.display()))
}
