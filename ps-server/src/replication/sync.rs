//! Shard copies between servers: a replica that is not in step with its
//! primary, and a new primary recovering the freshest copy, fetch a whole
//! shard from another server.
//!
//! The source takes every table's rows of the shard under the shard's
//! write lock (so the copy holds whole Pushes only and matches its
//! version), as one blob — the number of tables (u32), then per table, by
//! name: the name's length (u32) and bytes, the row file's length (u64)
//! and bytes ([`crate::rowfile`]) — and
//! keeps it as a *session* that the caller fetches in 1 MiB chunks
//! (`SyncChunk`), so that no message approaches the transport's limit.
//! The caller decodes the whole blob before it changes anything, then
//! replaces the shard's rows with it under the write lock.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_proto::v1::{ReplicationClient, SyncChunkRequest, SyncRequest, SyncResponse};
use tessera_rpc::{RpcError, Status};

use super::Replication;
use crate::rowfile::{self, ShardImage};
use crate::store::{ShardGuard, ShardSnapshot, Store};
use crate::version::Version;

/// Bytes per `SyncChunk` answer: well under any message limit, large
/// enough that a big shard takes few round trips.
const CHUNK_BYTES: usize = 1 << 20;
/// A copy not fetched within this long is dropped.
const SESSION_EXPIRY: Duration = Duration::from_secs(120);

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
}

/// A copy fetched from another server ([`Replication::fetch_copy`]).
#[derive(Debug)]
pub(crate) struct Fetched {
    /// The source's epoch as the shard's primary (when attaching).
    pub epoch: u64,
    /// The copy's version.
    pub version: Version,
    /// Its tables and size in bytes; `None` when it is the caller's own
    /// version (nothing to copy).
    pub images: Option<(Vec<(String, ShardImage)>, usize)>,
    /// The attachment the source made (when attaching).
    pub attachment: u64,
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
                version: Some(own.into()),
                attach,
            })
            .await
            .map_err(|source| CopyError::Rpc {
                addr: from.to_owned(),
                source,
            })?;
        let version: Version = answer.version.unwrap_or_default().into();
        if version < own {
            return Err(CopyError::Older {
                offered: version,
                own,
            });
        }
        let images = if answer.total_bytes == 0 && version == own {
            None
        } else {
            let data = download(&client, from, &answer).await?;
            Some((decode(&self.store, &data)?, data.len()))
        };
        Ok(Fetched {
            epoch: answer.epoch,
            version,
            images,
            attachment: answer.attachment,
        })
    }
}

/// Every table's rows of a shard snapshot, as one blob (module docs).
/// Encoded after the shard's lock is released.
pub(crate) fn encode_blob(snapshot: &ShardSnapshot<'_>) -> Vec<u8> {
    let files = snapshot.encode();
    let mut blob = Vec::with_capacity(
        4 + files
            .iter()
            .map(|(n, f, _)| n.len() + f.len() + 12)
            .sum::<usize>(),
    );
    blob.extend_from_slice(&(files.len() as u32).to_le_bytes());
    for (name, bytes, _) in files {
        blob.extend_from_slice(&(name.len() as u32).to_le_bytes());
        blob.extend_from_slice(name.as_bytes());
        blob.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        blob.extend_from_slice(&bytes);
    }
    blob
}

/// Parses a blob into each table's image, checking every table against
/// `store`'s configuration.
pub(crate) fn decode(
    store: &Store,
    mut data: &[u8],
) -> Result<Vec<(String, ShardImage)>, CopyError> {
    fn take<'a>(n: usize, data: &mut &'a [u8]) -> Result<&'a [u8], CopyError> {
        if data.len() < n {
            return Err(CopyError::Truncated);
        }
        let (head, rest) = data.split_at(n);
        *data = rest;
        Ok(head)
    }
    let mut count = [0u8; 4];
    count.copy_from_slice(take(4, &mut data)?);
    let mut out = Vec::new();
    for _ in 0..u32::from_le_bytes(count) {
        let mut len = [0u8; 4];
        len.copy_from_slice(take(4, &mut data)?);
        let name = std::str::from_utf8(take(u32::from_le_bytes(len) as usize, &mut data)?)
            .map_err(|_| CopyError::BadName)?
            .to_owned();
        let mut len = [0u8; 8];
        len.copy_from_slice(take(8, &mut data)?);
        let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| CopyError::Truncated)?;
        let bytes = take(len, &mut data)?;
        let table = store
            .table(&name)
            .ok_or_else(|| CopyError::UnknownTable(name.clone()))?;
        let config = table.config();
        let image = rowfile::decode(bytes, config.dim, config.optimizer.slots() as u32).map_err(
            |source| CopyError::Rows {
                table: name.clone(),
                source,
            },
        )?;
        out.push((name, image));
    }
    if !data.is_empty() {
        return Err(CopyError::Trailing(data.len()));
    }
    Ok(out)
}

/// Makes the shard `guard` locks hold exactly `images` (tables the copy
/// lacks are emptied); returns the rows installed.
pub(crate) fn install(
    store: &Store,
    guard: &ShardGuard<'_>,
    images: Vec<(String, ShardImage)>,
    now: Instant,
) -> usize {
    let shard = guard.shard();
    let mut images: HashMap<String, ShardImage> = images.into_iter().collect();
    let mut rows = 0;
    for table in store.tables() {
        let image = images.remove(&table.config().name).unwrap_or_default();
        rows += image.rows.len();
        table.replace(guard, shard, image, now);
    }
    rows
}

/// Fetches the copy `session` describes from `addr`.
pub(crate) async fn download(
    client: &ReplicationClient,
    addr: &str,
    session: &SyncResponse,
) -> Result<Vec<u8>, CopyError> {
    // Capacity bounded: the total is the peer's word, the chunks are not.
    let mut data = Vec::with_capacity(session.total_bytes.min(1 << 30) as usize);
    while (data.len() as u64) < session.total_bytes {
        let chunk = client
            .sync_chunk(SyncChunkRequest {
                session: session.session,
                offset: data.len() as u64,
            })
            .await
            .map_err(|source| CopyError::Rpc {
                addr: addr.to_owned(),
                source,
            })?;
        if chunk.data.is_empty() {
            return Err(CopyError::EmptyChunk(addr.to_owned()));
        }
        data.extend_from_slice(&chunk.data);
    }
    Ok(data)
}

/// Copies waiting to be fetched.
#[derive(Debug)]
pub(crate) struct Sessions {
    open: Mutex<HashMap<u64, Session>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct Session {
    data: Bytes,
    created: Instant,
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
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `data` for fetching; returns its session id.
    pub fn open(&self, data: Vec<u8>) -> u64 {
        let now = Instant::now();
        let id = self.next.fetch_add(2, Ordering::Relaxed);
        let mut open = self.lock();
        open.retain(|_, s| now.saturating_duration_since(s.created) < SESSION_EXPIRY);
        open.insert(
            id,
            Session {
                data: Bytes::from(data),
                created: now,
            },
        );
        id
    }

    /// The chunk of `session` at `offset`; the session ends with its last
    /// chunk.
    pub fn chunk(&self, session: u64, offset: u64) -> Result<Bytes, Status> {
        let mut open = self.lock();
        let found = open
            .get(&session)
            .ok_or_else(|| Status::not_found(format!("no sync session {session:#x}")))?;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(found.data.len());
        let end = (start + CHUNK_BYTES).min(found.data.len());
        let data = found.data.slice(start..end);
        if end == found.data.len() {
            open.remove(&session);
        }
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OptimizerConfig, PsServerConfig, TableConfig};
    use crate::store::PushId;
    use tessera_proto::rows::put_f32s;

    fn store() -> Store {
        Store::new(&PsServerConfig {
            tables: vec![
                TableConfig {
                    optimizer: OptimizerConfig::adam(0.1),
                    ..TableConfig::new("a", 3)
                },
                TableConfig::new("b", 2),
            ],
            ..PsServerConfig::default()
        })
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
        let blob = encode_blob(&source.snapshot_shard(&source.lock_shard(0).unwrap()));
        let target = store();
        // Rows the copy does not have disappear.
        let mut one = Vec::new();
        put_f32s(&mut one, &[1.0, 1.0]);
        target.push("b", 0, &[77], &one, PushId::default()).unwrap();
        let images = decode(&target, &blob).unwrap();
        let rows = install(
            &target,
            &target.lock_shard(0).unwrap(),
            images,
            Instant::now(),
        );
        assert_eq!(rows, 10);
        assert_eq!(
            encode_blob(&target.snapshot_shard(&target.lock_shard(0).unwrap())).len(),
            blob.len()
        );
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
        // Every truncation is refused.
        for cut in 0..blob.len() {
            assert!(decode(&target, &blob[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = blob.clone();
        longer.push(0);
        assert!(matches!(
            decode(&target, &longer),
            Err(CopyError::Trailing(1))
        ));
    }

    #[test]
    fn sessions_serve_chunks_and_end() {
        let sessions = Sessions::new();
        let id = sessions.open(vec![7u8; CHUNK_BYTES + 10]);
        assert_eq!(sessions.chunk(id, 0).unwrap().len(), CHUNK_BYTES);
        assert_eq!(sessions.chunk(id, CHUNK_BYTES as u64).unwrap().len(), 10);
        assert!(sessions.chunk(id, 0).is_err(), "ended with its last chunk");
    }
}
