//! Shard copies between servers: a replica that is not in step with its
//! primary, and a new primary recovering the freshest copy, fetch a whole
//! shard from another server.
//!
//! The source cuts the shard under its write lock (a snapshot sharing
//! every row, so the copy holds whole Pushes only and matches its version,
//! and the lock is held for a reference per row), and keeps it as a
//! *session* ([`Sessions`]) that the caller fetches in 1 MiB chunks
//! (`SyncChunk`), each encoded when asked ([`tessera_store::copy_stream`]): no
//! message approaches the transport's limit, and the copy never exists as
//! one blob. The stream is the number of tables (u32), then per table, by
//! name: the name's length (u32) and bytes, the row file's length (u64)
//! and bytes ([`tessera_store::rowfile`]).
//!
//! The caller decodes each chunk as it comes into rows staged beside its
//! own ([`Staged`]), changing nothing it serves, then swaps them in under
//! the shard's write lock in one step. A replica holds the Pushes its
//! primary forwards meanwhile and applies them after the copy
//! ([`super::pending`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_rpc::sync::LockExt;

use bytes::Bytes;
use tessera_proto::v1::{ReplicationClient, SyncChunkRequest, SyncRequest, SyncResponse};
use tessera_rpc::{RpcError, Status};

use super::Replication;
use tessera_store::copy_stream::{CopyDecoder, CopyItem, CopySource};
use tessera_store::image::TableShape;
use tessera_store::rowfile;
use tessera_store::store::{ShardGuard, Store};
use tessera_store::version::Version;

/// Bytes per `SyncChunk` answer: well under any message limit, large
/// enough that a big shard takes few round trips.
const CHUNK_BYTES: usize = 1 << 20;
/// A copy no chunk was asked of for this long is dropped: its caller died
/// or gave up (a live one asks every chunk within a request timeout).
pub(crate) const SESSION_IDLE: Duration = Duration::from_secs(30);

/// Why a shard copy could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CopyError {
    /// A call to the source failed.
    #[error("{addr}: {source}")]
    Rpc {
        /// The source.
        addr: String,
        /// Why.
        source: RpcError,
    },
    /// The source sent an empty chunk before the end of the copy.
    #[error("{0} sent an empty chunk before the end of the copy")]
    EmptyChunk(String),
    /// The copy ends in the middle of a table.
    #[error("the copy is truncated")]
    Truncated,
    /// Bytes after the last table.
    #[error("{0} bytes after the end of the copy")]
    Trailing(usize),
    /// A table name is not UTF-8.
    #[error("a table name in the copy is not UTF-8")]
    BadName,
    /// The source has a table this server is not configured with.
    #[error("the copy has a table `{0}` this server lacks")]
    UnknownTable(String),
    /// A table's rows do not decode.
    #[error("table `{table}` of the copy: {source}")]
    Rows {
        /// The table.
        table: String,
        /// Why.
        source: rowfile::DecodeError,
    },
    /// The copy names a table twice.
    #[error("the copy has table `{0}` twice")]
    DuplicateTable(String),
    /// The copy's stream does not decode.
    #[error(transparent)]
    Stream(tessera_store::copy_stream::StreamError),
    /// The copy is older than the caller's own (a replica never copies
    /// from an older copy).
    #[error("the copy at {offered} is older than this server's at {own}")]
    Older {
        /// The copy's version.
        offered: Version,
        /// The caller's.
        own: Version,
    },
    /// The shard's role changed while the copy was on its way.
    #[error("the shard's role changed while copying")]
    Superseded,
    /// The source is not a configured peer.
    #[error("{0} is not a configured peer")]
    UnknownPeer(String),
    /// The copy has more rows than a stripe of this server holds.
    #[error("table `{table}` of the copy: {source}")]
    Full {
        /// The table.
        table: String,
        /// Why.
        source: tessera_store::table::StripeFull,
    },
}

/// A copy fetched from another server ([`Replication::fetch_copy`]).
#[derive(Debug)]
pub(crate) struct Fetched {
    /// The source's epoch as the shard's primary (when attaching).
    pub epoch: u64,
    /// The copy's version.
    pub version: Version,
    /// The copy, staged aside; `None` when it is the caller's own version
    /// (nothing to copy).
    pub copy: Option<Staged>,
    /// The attachment the source made (when attaching).
    pub attachment: u64,
    /// A receiving shard's giving shards' windows, as the source keeps
    /// them (`Store::origin_windows`).
    pub origins: Option<tessera_store::store::OriginSet>,
}

impl Fetched {
    /// Keeps the copy's giving shards' windows on the shard `writing`
    /// locks (a copy installed, or found in step).
    pub(crate) fn keep_origins(&self, store: &Store, writing: &ShardGuard<'_>) {
        if let Some(set) = &self.origins {
            store.set_origin_windows(writing.shard(), set.clone());
        }
        // A copy of a shard whose keys moved away may still hold rows a
        // finished growth moved (its source had not dropped them yet):
        // they go now, as they did here.
        store.drop_unrouted(writing);
    }
}

impl Replication {
    /// Asks `from` for a copy of `shard` (attaching this server as its
    /// replica when `attach`), refuses one older than `own`, and fetches
    /// and decodes it unless it is `own` already. Changes nothing here.
    pub(crate) async fn fetch_copy(
        &self,
        shard: u32,
        from: &str,
        own: Version,
        attach: bool,
    ) -> Result<Fetched, CopyError> {
        let client = self
            .client(from)
            .ok_or_else(|| CopyError::UnknownPeer(from.to_owned()))?
            .clone();
        let answer = client
            .sync(SyncRequest {
                shard,
                replica: self.me.clone(),
                version: Some(crate::wire::version_to_wire(own)),
                attach,
            })
            .await
            .map_err(|source| CopyError::Rpc {
                addr: from.to_owned(),
                source,
            })?;
        let version = crate::wire::version_from_wire(answer.version.unwrap_or_default());
        if version < own {
            return Err(CopyError::Older {
                offered: version,
                own,
            });
        }
        let copy = if answer.total_bytes == 0 && version == own {
            None
        } else {
            Some(download(&self.store, &client, from, &answer).await?)
        };
        Ok(Fetched {
            epoch: answer.epoch,
            version,
            copy,
            attachment: answer.attachment,
            origins: answer.origins.as_ref().map(crate::wire::origins_from_wire),
        })
    }
}

/// A copy downloaded into rows of its own, beside the live ones: the old
/// rows stay (served no longer, but a candidate for recovery should the
/// source die mid-copy) until [`Staged::install`] swaps the new ones in
/// under the shard's write lock, in one step. Memory: the old rows and the
/// new ones, never the download as bytes or as a decoded image besides.
#[derive(Debug, Default)]
pub(crate) struct Staged {
    tables: Vec<StagedTable>,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Rows in the copy.
    pub rows: usize,
}

#[derive(Debug)]
struct StagedTable {
    name: String,
    rows: tessera_store::table::ShardRows,
    dedup: Vec<tessera_store::dedup::WorkerWindow>,
    /// The stamp of a copied row without one (a table expiring
    /// `after_secs`: the time the copy arrived; 0 otherwise).
    unstamped: u32,
}

impl Staged {
    /// Makes the shard `guard` locks hold exactly this copy (tables the
    /// copy lacks are emptied); returns the rows installed and the old
    /// rows, to drop after the lock is released.
    pub fn install(
        mut self,
        store: &Store,
        guard: &ShardGuard<'_>,
        now: Instant,
    ) -> (usize, Vec<tessera_store::table::ShardRows>) {
        let shard = guard.shard();
        let mut rows = 0;
        let mut old = Vec::new();
        for table in store.tables() {
            let staged = match self
                .tables
                .iter()
                .position(|t| t.name == table.config().name)
            {
                Some(i) => self.tables.swap_remove(i),
                None => StagedTable {
                    name: table.config().name.clone(),
                    rows: table.staging_rows(),
                    dedup: Vec::new(),
                    unstamped: 0,
                },
            };
            rows += table.swap_in(guard, shard, &staged.rows, &staged.dedup, now);
            old.push(staged.rows);
        }
        (rows, old)
    }
}

/// Fetches the copy `session` describes from `addr` chunk by chunk,
/// decoding each as it comes ([`CopyDecoder`]) into rows staged aside, and
/// ends the session.
pub(crate) async fn download(
    store: &Arc<Store>,
    client: &ReplicationClient,
    addr: &str,
    session: &SyncResponse,
) -> Result<Staged, CopyError> {
    let mut stager = Some(Stager::new(Arc::clone(store)));
    let fetched = async {
        let mut at = 0u64;
        while at < session.total_bytes {
            let chunk = client
                .sync_chunk(SyncChunkRequest {
                    session: session.session,
                    offset: at,
                    release: false,
                })
                .await
                .map_err(|source| CopyError::Rpc {
                    addr: addr.to_owned(),
                    source,
                })?;
            if chunk.data.is_empty() {
                return Err(CopyError::EmptyChunk(addr.to_owned()));
            }
            at += chunk.data.len() as u64;
            // Decoding a megabyte of rows: off the async threads.
            let mut feeding = stager.take().ok_or(CopyError::Superseded)?;
            let fed = tokio::task::spawn_blocking(move || {
                let fed = feeding.feed(&chunk.data);
                (feeding, fed)
            })
            .await
            .map_err(|_| CopyError::Superseded)?;
            stager = Some(fed.0);
            fed.1?;
        }
        Ok(())
    }
    .await;
    // Best effort: an unreleased session ends when it has been idle long
    // enough.
    let _ = client
        .sync_chunk(SyncChunkRequest {
            session: session.session,
            offset: 0,
            release: true,
        })
        .await;
    fetched?;
    stager.ok_or(CopyError::Superseded)?.finish()
}

/// The receiver's shape of a table, by name.
type ShapeOf = Box<dyn Fn(&str) -> Option<TableShape> + Send + Sync>;

/// Decodes a copy's chunks into a [`Staged`] copy as they come.
pub(crate) struct Stager {
    store: Arc<Store>,
    decoder: CopyDecoder<ShapeOf>,
    staged: Staged,
    items: Vec<CopyItem>,
}

impl Stager {
    pub fn new(store: Arc<Store>) -> Self {
        let shapes = Arc::clone(&store);
        let shape_of = move |name: &str| {
            let store = &shapes;
            store.table(name).map(|t| TableShape {
                name: name.to_owned(),
                dim: t.config().dim,
                slots: t.config().optimizer.slots() as u32,
            })
        };
        Self {
            store,
            decoder: CopyDecoder::new(Box::new(shape_of)),
            staged: Staged::default(),
            items: Vec::new(),
        }
    }

    /// Takes the next chunk.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<(), CopyError> {
        self.staged.bytes += chunk.len() as u64;
        self.decoder
            .handle_bytes(chunk, &mut self.items)
            .map_err(CopyError::Stream)?;
        for item in std::mem::take(&mut self.items) {
            self.staged.take(&self.store, item)?;
        }
        Ok(())
    }

    /// The staged copy, if the stream ended where a copy ends.
    pub fn finish(self) -> Result<Staged, CopyError> {
        self.decoder.finish().map_err(CopyError::Stream)?;
        Ok(self.staged)
    }
}

impl Staged {
    fn take(&mut self, store: &Store, item: CopyItem) -> Result<(), CopyError> {
        match item {
            CopyItem::Table(name) => {
                let table = store
                    .table(&name)
                    .ok_or_else(|| CopyError::UnknownTable(name.clone()))?;
                if self.tables.iter().any(|t| t.name == name) {
                    return Err(CopyError::DuplicateTable(name));
                }
                let unstamped = match table.config().expiry.map(|e| e.bound()) {
                    Some(bound @ tessera_store::table::expiry::Bound::Secs(_)) => {
                        bound.now(tessera_store::table::expiry::unix_secs(), 0)
                    }
                    _ => 0,
                };
                self.tables.push(StagedTable {
                    name,
                    rows: table.staging_rows(),
                    dedup: Vec::new(),
                    unstamped,
                });
            }
            CopyItem::Row(mut saved) => {
                let table = self.tables.last().ok_or(CopyError::Truncated)?;
                if saved.stamp == 0 {
                    // No stamp (a copy from a server without expiry): the
                    // row counts as pushed now, not in 1970.
                    saved.stamp = table.unstamped;
                }
                table
                    .rows
                    .insert(
                        saved.key,
                        saved.steps,
                        saved.stamp,
                        &saved.values,
                        &saved.state,
                    )
                    .map_err(|source| CopyError::Full {
                        table: table.name.clone(),
                        source,
                    })?;
                self.rows += 1;
            }
            CopyItem::Windows(windows) => {
                let table = self.tables.last_mut().ok_or(CopyError::Truncated)?;
                table.dedup = windows;
            }
        }
        Ok(())
    }
}

/// The chunk of `source` at `offset`: at most [`CHUNK_BYTES`].
pub(crate) fn encode_chunk(source: &CopySource, offset: u64) -> Bytes {
    Bytes::from(source.read_at(offset, CHUNK_BYTES))
}

/// Copies being fetched: one session per (caller, shard).
///
/// A session holds its copy's snapshot ([`CopySource`]: rows shared with
/// the live store) and serves any chunk of it, as often as asked (a lost
/// answer is asked again). It ends when its caller releases it (after the
/// last chunk, or giving up), when the same caller asks for a new copy of
/// the same shard (a retry replaces its old session, so a flaky link
/// cannot pile copies up), or after [`SESSION_IDLE`] without a chunk
/// request (a caller that died), swept by a timer ([`Sessions::sweep`]).
#[derive(Debug)]
pub(crate) struct Sessions {
    open: Mutex<HashMap<u64, Session>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct Session {
    source: Arc<CopySource>,
    owner: (String, u32),
    last_used: Instant,
}

impl Sessions {
    pub fn new() -> Self {
        Self {
            open: Mutex::new(HashMap::new()),
            // Random, odd, stepping by two: never 0, hard to guess.
            next: AtomicU64::new(rand::random::<u64>() | 1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Session>> {
        self.open.locked()
    }

    /// Keeps `source` for `caller`'s copy of `shard`, ending any session
    /// that caller had for the shard; returns the session id.
    pub fn open(&self, caller: &str, shard: u32, source: CopySource) -> u64 {
        let id = self.next.fetch_add(2, Ordering::Relaxed);
        let owner = (caller.to_owned(), shard);
        let mut open = self.lock();
        let before = open.len();
        open.retain(|_, s| s.owner != owner);
        if open.len() < before {
            metrics::counter!("tessera_ps_sync_sessions_replaced_total").increment(1);
        }
        open.insert(
            id,
            Session {
                source: Arc::new(source),
                owner,
                last_used: Instant::now(),
            },
        );
        metrics::gauge!("tessera_ps_sync_sessions").set(open.len() as f64);
        id
    }

    /// The copy of `session`, marked used now.
    pub fn source(&self, session: u64) -> Result<Arc<CopySource>, Status> {
        let mut open = self.lock();
        let found = open
            .get_mut(&session)
            .ok_or_else(|| Status::not_found(format!("no sync session {session:#x}")))?;
        found.last_used = Instant::now();
        Ok(Arc::clone(&found.source))
    }

    /// The chunk of `session` at `offset` (empty at the end), encoded on
    /// the calling thread (the service does it off the async threads).
    #[cfg(test)]
    pub fn chunk(&self, session: u64, offset: u64) -> Result<Bytes, Status> {
        Ok(encode_chunk(&*self.source(session)?, offset))
    }

    /// Ends `session` (its caller has the copy, or gave up).
    pub fn release(&self, session: u64) {
        let mut open = self.lock();
        open.remove(&session);
        metrics::gauge!("tessera_ps_sync_sessions").set(open.len() as f64);
    }

    /// Ends the sessions idle for [`SESSION_IDLE`] at `now`; returns how
    /// many.
    pub fn sweep(&self, now: Instant) -> usize {
        let mut open = self.lock();
        let before = open.len();
        open.retain(|_, s| now.saturating_duration_since(s.last_used) < SESSION_IDLE);
        metrics::gauge!("tessera_ps_sync_sessions").set(open.len() as f64);
        before - open.len()
    }

    /// Sessions open now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OptimizerConfig, StoreConfig, TableConfig};
    use tessera_proto::rows::put_f32s;
    use tessera_store::store::PushId;

    fn store() -> Store {
        Store::new(&StoreConfig {
            tables: vec![
                TableConfig {
                    optimizer: OptimizerConfig::adam(0.1),
                    ..TableConfig::new("a", 3)
                },
                TableConfig::new("b", 2),
            ],
            ..StoreConfig::default()
        })
    }

    /// Every table's rows of shard 0, as a copy streams them.
    fn blob(store: &Store) -> Vec<u8> {
        let source = CopySource::new(store.snapshot_shard(&store.lock_shard(0).unwrap()));
        source.read_at(0, usize::try_from(source.total_bytes()).unwrap())
    }

    #[test]
    fn a_copy_replaces_every_table_bit_for_bit() {
        let source = store();
        let mut grads = Vec::new();
        put_f32s(&mut grads, &[0.5; 30]);
        let id = PushId {
            worker: 3,
            sequence: 1,
        };
        source
            .push("a", 0, &(0..10).collect::<Vec<_>>(), &grads, id)
            .unwrap();
        let bytes = blob(&source);
        let target = store();
        // Rows the copy does not have disappear.
        let mut one = Vec::new();
        put_f32s(&mut one, &[1.0, 1.0]);
        target.push("b", 0, &[77], &one, PushId::default()).unwrap();
        // Staged from chunks of any size, then swapped in.
        let target = Arc::new(target);
        let mut stager = Stager::new(Arc::clone(&target));
        for chunk in bytes.chunks(7) {
            stager.feed(chunk).unwrap();
        }
        let staged = stager.finish().unwrap();
        assert_eq!((staged.rows, staged.bytes), (10, bytes.len() as u64));
        let (rows, _old) = staged.install(&target, &target.lock_shard(0).unwrap(), Instant::now());
        assert_eq!(rows, 10);
        assert_eq!(blob(&target).len(), bytes.len());
        assert_eq!(target.table("b").unwrap().rows(), 0);
        assert_eq!(
            target.fetch("a", 0, &[4]).unwrap(),
            source.fetch("a", 0, &[4]).unwrap()
        );
        assert!(
            target
                .push("a", 0, &[1], &grads[..12], id)
                .unwrap()
                .duplicate
        );
        // Every truncation is refused, and so is a byte past the end.
        let stage = |part: &[u8]| {
            let mut stager = Stager::new(Arc::clone(&target));
            stager.feed(part)?;
            stager.finish().map(drop)
        };
        for cut in 0..bytes.len() {
            assert!(stage(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(stage(&longer).is_err());
    }

    #[test]
    fn sessions_serve_any_chunk_until_released_replaced_or_idle() {
        let source = store();
        let keys: Vec<u64> = (0..80_000).collect();
        let mut grads = Vec::new();
        put_f32s(&mut grads, &vec![0.5; keys.len() * 2]);
        source
            .push("b", 0, &keys, &grads, PushId::default())
            .unwrap();
        let copy = || CopySource::new(source.snapshot_shard(&source.lock_shard(0).unwrap()));
        let total = copy().total_bytes();
        assert!(
            total > CHUNK_BYTES as u64,
            "{total} bytes: more than one chunk"
        );
        let sessions = Sessions::new();
        let id = sessions.open("r:1", 0, copy());
        let first = sessions.chunk(id, 0).unwrap();
        assert_eq!(first.len(), CHUNK_BYTES);
        let last = sessions.chunk(id, CHUNK_BYTES as u64).unwrap();
        assert_eq!(last.len() as u64, total - CHUNK_BYTES as u64);
        // A chunk whose answer was lost is asked again: the same bytes.
        assert_eq!(sessions.chunk(id, CHUNK_BYTES as u64).unwrap(), last);
        assert_eq!(sessions.chunk(id, 0).unwrap(), first);
        assert!(sessions.chunk(id, total).unwrap().is_empty());
        sessions.release(id);
        assert!(sessions.chunk(id, 0).is_err(), "released");
        // A caller asking again replaces its session; others keep theirs.
        let a = sessions.open("r:1", 0, copy());
        let b = sessions.open("r:2", 0, copy());
        let c = sessions.open("r:1", 0, copy());
        assert!(sessions.chunk(a, 0).is_err(), "replaced");
        assert!(sessions.chunk(b, 0).is_ok() && sessions.chunk(c, 0).is_ok());
        assert_eq!(sessions.len(), 2);
        // Idle ones end when swept.
        assert_eq!(sessions.sweep(Instant::now()), 0);
        assert_eq!(sessions.sweep(Instant::now() + SESSION_IDLE), 2);
        assert_eq!(sessions.len(), 0);
    }
}
