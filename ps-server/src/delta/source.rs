//! A training server's copies for serving servers that fell out of a
//! delta stream (or never were in one): a snapshot of the shard, taken
//! under its write lock with the stream's mark (`sender.rs`), read page
//! by page, each page the rows whose keys the asking server hosts.
//!
//! A snapshot costs nothing per row (`tessera_store`'s `rows/slab.rs`), so the lock
//! is held for a moment; pages are read from it while Pushes go on. A
//! session idle for [`SESSION_IDLE`] is dropped, and at most
//! [`MAX_SESSIONS`] are open (the oldest goes first).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tessera_proto::sharding::shard_for_key;
use tessera_proto::v1::{DeltaCopyRequest, DeltaCopyResponse, DeltaTable};
use tessera_rpc::Status;
use tessera_rpc::sync::LockExt;

use super::sender::{Mark, Sender};
use tessera_store::image::ShardSnapshot;
use tessera_store::store::Store;

/// How long an unused copy session is kept (its snapshot holds a copy of
/// every row Pushes change meanwhile).
pub const SESSION_IDLE: Duration = Duration::from_secs(30);

/// Copy sessions open at once at most: one more is refused
/// (`RESOURCE_EXHAUSTED`; the serving server tries again later), never
/// made by ending one in use.
pub const MAX_SESSIONS: usize = 64;

/// Bytes of rows one page carries at most.
pub const PAGE_BYTES: usize = 4 << 20;

/// Rows one page reads at most (a page of a server hosting few of the
/// serving shards skips most rows; this bounds the time one takes).
pub const PAGE_SCAN_ROWS: u64 = 1 << 18;

/// Most serving shards a copy request may name.
pub const MAX_SERVING_SHARDS: u32 = 1 << 16;

#[derive(Debug)]
struct Session {
    snapshot: ShardSnapshot,
    mark: Mark,
    last_used: Instant,
}

/// The copy sessions of a training server.
#[derive(Debug)]
pub struct Sources {
    open: Mutex<HashMap<u64, Session>>,
    next: AtomicU64,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            open: Mutex::new(HashMap::new()),
            // Random, odd, stepping by two: never 0, hard to guess.
            next: AtomicU64::new(rand::random::<u64>() | 1),
        }
    }
}

impl Sources {
    /// One page of a copy (a new session when `request.session` is 0):
    /// blocking, for a blocking thread.
    pub fn page(
        &self,
        store: &Store,
        sender: Option<&Sender>,
        request: &DeltaCopyRequest,
    ) -> Result<DeltaCopyResponse, Status> {
        self.open
            .locked()
            .retain(|_, s| s.last_used.elapsed() < SESSION_IDLE);
        if request.release {
            self.open.locked().remove(&request.session);
            return Ok(DeltaCopyResponse::default());
        }
        if request.num_shards == 0 || request.num_shards > MAX_SERVING_SHARDS {
            return Err(Status::invalid_argument(format!(
                "num_shards = {} is outside 1..={MAX_SERVING_SHARDS}",
                request.num_shards
            )));
        }
        let mut wanted = vec![false; request.num_shards as usize];
        for &s in &request.shards {
            match wanted.get_mut(s as usize) {
                Some(w) => *w = true,
                None => {
                    return Err(Status::invalid_argument(format!(
                        "serving shard {s} is not below num_shards = {}",
                        request.num_shards
                    )));
                }
            }
        }
        // A growth's new shard holds only part of its rows until it opens:
        // a serving fleet copies it once it does (its first delta after
        // the opening is a gap to the serving fleet, `sender.rs`).
        if request.serving && store.receiving(request.source_shard) {
            return Err(Status::unavailable(format!(
                "shard {} receives its keys in a resize; copy it once it serves them",
                request.source_shard
            )));
        }
        let session = match request.session {
            0 => self.start(store, sender, request.source_shard)?,
            id => id,
        };
        let (snapshot, mark) = {
            let mut open = self.open.locked();
            let found = open
                .get_mut(&session)
                .ok_or_else(|| Status::not_found(format!("no delta copy session {session:#x}")))?;
            found.last_used = Instant::now();
            (found.snapshot.clone(), found.mark)
        };
        let mut response = DeltaCopyResponse {
            session,
            stream: mark.stream,
            seq: mark.seq,
            epoch: mark.epoch,
            position: mark.position,
            fenced: mark.fenced != 0 && mark.fenced == request.num_shards,
            ..DeltaCopyResponse::default()
        };
        if response.fenced {
            response.fenced_at = mark.fenced_at;
        }
        // A fenced copy's first page carries the shard's deduplication
        // windows (`store/resize.rs`).
        if response.fenced && request.session == 0 && request.optimizer_state {
            response.windows =
                crate::wire::windows_to_wire(&store.dedup_windows(request.source_shard));
        }
        // A serving fleet's copy after the fence leaves the moved keys
        // out: their new shard serves them, and frozen here they would
        // overwrite the fresher values its stream gave the serving fleet.
        let num_shards = match (request.serving, mark.fenced) {
            (true, fenced) if fenced != 0 => fenced,
            _ => store.route_count(request.source_shard),
        };
        response.routed_by = num_shards;
        let (mut t, mut row) = (request.table as usize, request.row);
        let mut bytes = 0usize;
        let mut scanned = 0u64;
        while t < snapshot.tables.len() && bytes < PAGE_BYTES && scanned < PAGE_SCAN_ROWS {
            let (shape, table) = &snapshot.tables[t];
            let mut out = DeltaTable {
                name: shape.name.clone(),
                ..DeltaTable::default()
            };
            let (mut values, mut state) = (Vec::new(), Vec::new());
            let mut at = row;
            let row_bytes = shape.dim as usize * 4;
            table
                .rows
                .for_each_from(usize::try_from(row).unwrap_or(usize::MAX), |r| {
                    at += 1;
                    scanned += 1;
                    let key = r.key();
                    // Only rows this shard owns (a copy installed after a
                    // finished growth may hold moved ones for a while).
                    if wanted[shard_for_key(key, request.num_shards) as usize]
                        && shard_for_key(key, num_shards) == request.source_shard
                    {
                        out.keys.push(key);
                        let from = values.len();
                        values.resize(from + row_bytes, 0);
                        r.write_values_le(&mut values[from..]);
                        if request.optimizer_state {
                            r.write_state_le(&mut state);
                            out.steps.push(r.steps());
                            out.stamps.push(r.stamp());
                        }
                        bytes += row_bytes + 8;
                    }
                    bytes < PAGE_BYTES && scanned < PAGE_SCAN_ROWS
                });
            out.values = values.into();
            out.state = state.into();
            if !out.keys.is_empty() {
                response.tables.push(out);
            }
            if at >= table.rows.len() as u64 {
                t += 1;
                row = 0;
            } else {
                row = at;
            }
        }
        response.next_table = t as u32;
        response.next_row = row;
        response.done = t >= snapshot.tables.len();
        if response.done {
            self.open.locked().remove(&session);
        }
        Ok(response)
    }

    /// A new session on `shard`: its snapshot and stream mark, taken
    /// together under the shard's write lock.
    fn start(&self, store: &Store, sender: Option<&Sender>, shard: u32) -> Result<u64, Status> {
        let (snapshot, mark) = {
            let writing = store.lock_shard(shard).ok_or_else(|| {
                Status::failed_precondition(format!(
                    "shard {shard} is not hosted here (hosted: {:?})",
                    store.hosted()
                ))
            })?;
            let mut mark = sender.map(|s| s.mark(shard)).unwrap_or_default();
            // Taken after a resize fenced the moving keys: the copy holds
            // every change to them.
            (mark.fenced, mark.fenced_at) = writing.moved().unwrap_or_default();
            (store.snapshot_shard(&writing), mark)
        };
        let id = self.next.fetch_add(2, Ordering::Relaxed);
        let mut open = self.open.locked();
        if open.len() >= MAX_SESSIONS {
            return Err(Status::resource_exhausted(format!(
                "{MAX_SESSIONS} delta copies are in progress here; try again shortly"
            )));
        }
        open.insert(
            id,
            Session {
                snapshot,
                mark,
                last_used: Instant::now(),
            },
        );
        metrics::counter!("tessera_ps_delta_copies_served_total").increment(1);
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, StoreConfig, TableConfig};
    use tessera_store::store::PushId;

    fn store() -> Store {
        let store = Store::new(&StoreConfig {
            mode: Mode::Training,
            tables: vec![TableConfig::new("t", 2)],
            ..StoreConfig::default()
        });
        let keys: Vec<u64> = (0..1000).collect();
        let grads = vec![0u8; keys.len() * 2 * 4];
        store
            .push("t", 0, &keys, &grads, PushId::default())
            .unwrap();
        store
    }

    fn ask(session: u64, table: u32, row: u64) -> DeltaCopyRequest {
        DeltaCopyRequest {
            source_shard: 0,
            num_shards: 3,
            shards: vec![1, 2],
            session,
            table,
            row,
            ..DeltaCopyRequest::default()
        }
    }

    /// A copy's pages hold exactly the rows of the serving shards asked
    /// for, once each; the session ends with the last page.
    #[test]
    fn pages_hold_the_asked_shards_rows_once() {
        let store = store();
        let sources = Sources::default();
        let mut seen = Vec::new();
        let mut page = sources.page(&store, None, &ask(0, 0, 0)).unwrap();
        loop {
            for t in &page.tables {
                assert_eq!(t.values.len(), t.keys.len() * 8);
                seen.extend(t.keys.iter().copied());
            }
            if page.done {
                break;
            }
            page = sources
                .page(
                    &store,
                    None,
                    &ask(page.session, page.next_table, page.next_row),
                )
                .unwrap();
        }
        seen.sort_unstable();
        let want: Vec<u64> = (0..1000).filter(|&k| shard_for_key(k, 3) != 0).collect();
        assert_eq!(seen, want);
        assert!(sources.open.locked().is_empty(), "the last page ends it");
        // No stream here (no sender): the mark is empty.
        assert_eq!((page.stream, page.seq), (0, 0));
        // Asked with the optimizer state, a page's rows come whole: each
        // with its updates applied and expiry stamp (zeros for this SGD
        // table without expiry, which keeps neither; the store's tests
        // cover rows that keep both).
        let whole = sources
            .page(
                &store,
                None,
                &DeltaCopyRequest {
                    optimizer_state: true,
                    ..ask(0, 0, 0)
                },
            )
            .unwrap();
        let t = &whole.tables[0];
        assert_eq!(
            (t.steps.len(), t.stamps.len()),
            (t.keys.len(), t.keys.len())
        );
        let back = store.read_rows("t", 0, &t.keys, true).unwrap();
        assert_eq!(
            (back.steps, back.stamps),
            (t.steps.clone(), t.stamps.clone())
        );
    }

    /// A serving fleet's copy of a shard that still receives its keys in
    /// a resize is refused until it opens (its rows are partial); once
    /// the shard fenced keys a resize moved away, a serving copy leaves
    /// them out and says it routes by the fence's count, while a copy for
    /// a resize's receiving shard still holds them (issue 57, hole 4).
    #[test]
    fn a_serving_copy_waits_for_the_opening_and_leaves_fenced_keys_out() {
        let store = store();
        let sources = Sources::default();
        let serving = DeltaCopyRequest {
            source_shard: 0,
            num_shards: 1,
            shards: vec![0],
            serving: true,
            ..DeltaCopyRequest::default()
        };
        store.set_receiving(0, true);
        let refused = sources.page(&store, None, &serving).unwrap_err();
        assert_eq!(refused.code(), tessera_rpc::Code::Unavailable);
        store.set_receiving(0, false);
        let keys = |page: &DeltaCopyResponse| -> Vec<u64> {
            assert!(page.done);
            let mut keys: Vec<u64> = page.tables.iter().flat_map(|t| t.keys.clone()).collect();
            keys.sort_unstable();
            keys
        };
        let whole = sources.page(&store, None, &serving).unwrap();
        assert_eq!(keys(&whole), (0..1000).collect::<Vec<u64>>());
        assert_eq!(whole.routed_by, 1);
        {
            let writing = store.lock_shard(0).unwrap();
            store.set_moved(&writing, Some((2, 5)));
        }
        let fenced = sources.page(&store, None, &serving).unwrap();
        let staying: Vec<u64> = (0..1000).filter(|&k| shard_for_key(k, 2) == 0).collect();
        assert!(staying.len() < 1000);
        assert_eq!(keys(&fenced), staying);
        assert_eq!(fenced.routed_by, 2);
        // A copy for a resize's receiving shard, whose feed routes by
        // `num_shards`.
        let for_resize_by = |num_shards| {
            sources
                .page(
                    &store,
                    None,
                    &DeltaCopyRequest {
                        serving: false,
                        num_shards,
                        ..serving.clone()
                    },
                )
                .unwrap()
        };
        let for_resize = for_resize_by(1);
        assert_eq!(keys(&for_resize).len(), 1000);
        assert_eq!(for_resize.routed_by, 1);
        assert!(!for_resize.fenced);
        assert_eq!(for_resize.fenced_at, 0);
        // A copy for the fence's count says the fence's map version: a
        // resize planned after it (an earlier one to that count was
        // cancelled) does not open on it.
        let for_fence = for_resize_by(2);
        assert!(for_fence.fenced);
        assert_eq!(for_fence.fenced_at, 5);
    }

    /// A session is let go when its caller gives up (`release`), and
    /// when it has been idle; beyond the limit a new one is refused
    /// rather than an open one ended.
    #[test]
    fn sessions_are_released_swept_and_bounded() {
        let store = store();
        let sources = Sources::default();
        let first = sources.page(&store, None, &ask(0, 0, 0)).unwrap();
        // 1,000 rows fit one page: it ended at once. Open one that stays.
        assert!(first.done);
        let id = sources.start(&store, None, 0).unwrap();
        assert_eq!(sources.open.locked().len(), 1);
        sources
            .page(
                &store,
                None,
                &DeltaCopyRequest {
                    session: id,
                    release: true,
                    ..DeltaCopyRequest::default()
                },
            )
            .unwrap();
        assert!(sources.open.locked().is_empty());
        for _ in 0..MAX_SESSIONS {
            sources.start(&store, None, 0).unwrap();
        }
        let refused = sources.start(&store, None, 0).unwrap_err();
        assert_eq!(refused.code(), tessera_rpc::Code::ResourceExhausted);
        // Idle ones go at the next page.
        for s in sources.open.locked().values_mut() {
            s.last_used = Instant::now() - SESSION_IDLE - Duration::from_secs(1);
        }
        let _ = sources.page(&store, None, &ask(0, 0, 0)).unwrap();
        assert!(sources.open.locked().is_empty());
    }
}
