//! A feed's copies of a training shard (or, in a resize, of a giving
//! shard): on a gap, the rows this server hosts are copied page by page
//! from the shard's primary (`delta/source.rs`), the rows of that shard
//! the copy no longer holds are removed, and the deltas held meanwhile
//! are applied; a failed copy is tried again with a growing pause.

use std::time::{Duration, Instant};

use super::*;

/// How long a failed copy waits before the next try, at first and at
/// most.
const COPY_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// A copy's mark and size.
#[derive(Debug)]
struct Copied {
    stream: u64,
    seq: u64,
    epoch: u64,
    position: u64,
    /// Taken after a resize's giving shard fenced its moving keys, and
    /// that shard's deduplication windows then.
    fenced: bool,
    /// The fence's shard-map version (0: a source before it was sent).
    fenced_at: u64,
    windows: Vec<TableWindows>,
    rows: u64,
    /// When it was asked for (its rows are at least that fresh).
    asked: Instant,
    took: Duration,
}

impl Feed {
    /// Copies `shard` into `slot` until a copy is in and the stream
    /// resumes after it, or the slot is of an older generation than the
    /// feed (then nothing more is written).
    pub(super) async fn copy_loop(
        self: Arc<Self>,
        shard: u32,
        slot: Arc<tokio::sync::Mutex<Slot>>,
    ) {
        let mut backoff = COPY_BACKOFF.0;
        loop {
            let (from, with_state, generation) = {
                let slot = slot.lock().await;
                if !self.current(&slot) {
                    return;
                }
                (
                    slot.follower.source().to_owned(),
                    slot.optimizer_state,
                    slot.generation,
                )
            };
            let copied = tokio::select! {
                copied = self.copy_once(shard, &from, with_state, generation) => copied,
                () = self.stop.cancelled() => return,
            };
            let mut guard = slot.lock().await;
            if !self.current(&guard) {
                return;
            }
            match copied {
                Ok(mark) => {
                    backoff = COPY_BACKOFF.0;
                    guard.copies += 1;
                    guard.rows_applied += mark.rows;
                    guard.epoch = mark.epoch;
                    guard.position = mark.position;
                    // As of this copy (another primary of the giving shard
                    // may not have fenced yet).
                    if mark.fenced && !guard.fenced {
                        self.fenced.notify_one();
                    }
                    guard.fenced = mark.fenced;
                    guard.fenced_at = mark.fenced_at;
                    guard.windows = mark.windows;
                    metrics::counter!("tessera_ps_serving_copies_total").increment(1);
                    tracing::info!(source_shard = shard, from = %from, rows = mark.rows, took = ?mark.took, "copied a training shard's rows");
                    let resume =
                        guard
                            .follower
                            .handle_copied(mark.stream, mark.seq, mark.epoch, mark.asked);
                    for request in resume.apply {
                        self.apply_delta(&mut guard, request).await;
                    }
                    if !resume.copy_again && !guard.follower.copying() {
                        guard.copy_running = false;
                        self.publish(shard, &guard);
                        return;
                    }
                    self.publish(shard, &guard);
                }
                Err(err) => {
                    guard.follower.handle_copy_failed();
                    self.warn(&mut guard, shard, &err);
                    drop(guard);
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = self.stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(COPY_BACKOFF.1);
                }
            }
        }
    }

    /// One copy of the rows this server hosts from training shard `shard`
    /// at `from`; then drops the rows of that training shard the copy did
    /// not hold.
    async fn copy_once(
        &self,
        shard: u32,
        from: &str,
        with_state: bool,
        generation: u64,
    ) -> Result<Copied, FeedError> {
        if from.is_empty() {
            return Err(FeedError::NoSource);
        }
        let started = Instant::now();
        let client = self.client(from).ok_or(FeedError::NoSource)?;
        let mut session = 0;
        let copied = self
            .copy_pages(shard, from, with_state, generation, &client, &mut session)
            .await;
        if copied.is_err() && session != 0 {
            // Best effort: the source lets the snapshot go now rather than
            // when it has been idle long enough.
            let _ = client
                .copy(DeltaCopyRequest {
                    session,
                    release: true,
                    ..DeltaCopyRequest::default()
                })
                .await;
        }
        let (first, rows) = copied?;
        Ok(Copied {
            stream: first.stream,
            seq: first.seq,
            epoch: first.epoch,
            position: first.position,
            fenced: first.fenced,
            fenced_at: first.fenced_at,
            windows: first.windows,
            rows,
            asked: started,
            took: started.elapsed(),
        })
    }

    /// The pages of one copy, written as they come; then the rows of that
    /// training shard the copy did not hold are removed. Returns the
    /// copy's first page without its rows (its mark) and the rows.
    async fn copy_pages(
        &self,
        shard: u32,
        from: &str,
        with_state: bool,
        generation: u64,
        client: &DeltaClient,
        session: &mut u64,
    ) -> Result<(tessera_proto::v1::DeltaCopyResponse, u64), FeedError> {
        let mut request = DeltaCopyRequest {
            source_shard: shard,
            num_shards: self.route_count(),
            shards: self.store.hosted().to_vec(),
            optimizer_state: with_state,
            serving: self.resize_gate.is_none(),
            ..DeltaCopyRequest::default()
        };
        let seen: Arc<Seen> = Arc::new(Mutex::new(HashMap::new()));
        let mut mark = None;
        let mut rows = 0u64;
        loop {
            let mut page = client
                .copy(request.clone())
                .await
                .map_err(|source| FeedError::Rpc {
                    addr: from.to_owned(),
                    source,
                })?;
            let tables = std::mem::take(&mut page.tables);
            *session = page.session;
            let (done, next_table, next_row) = (page.done, page.next_table, page.next_row);
            if mark.is_none() {
                mark = Some(page);
            }
            rows += tables.iter().map(|t| t.keys.len() as u64).sum::<u64>();
            if self.generation.load(Ordering::SeqCst) != generation {
                return Err(FeedError::Reset);
            }
            self.write(tables, Some(Arc::clone(&seen))).await?;
            if done {
                break;
            }
            request.session = *session;
            request.table = next_table;
            request.row = next_row;
        }
        // Rows of this training shard that it no longer has (removed
        // while this server was out of the stream).
        if self.generation.load(Ordering::SeqCst) != generation {
            return Err(FeedError::Reset);
        }
        let store = Arc::clone(&self.store);
        // The rows the copy stands for: those the source routes to itself
        // by the count it says (after a resize's fence, the moved keys
        // are its new shard's), else the training fleet's count.
        let source_shards = match mark.as_ref().map_or(0, |m| m.routed_by) {
            0 => self.source_shards.load(Ordering::Relaxed).max(1),
            routed_by => routed_by,
        };
        let resize = self.resize_check();
        let removed = tokio::task::spawn_blocking(move || {
            let seen = seen.locked();
            let mut removed = 0usize;
            for &serving in store.hosted() {
                // A resize feed's copy writes only the receiving shards.
                let Ok(writing) = lock_for_feed(&store, serving, resize.as_ref()) else {
                    continue;
                };
                let names: Vec<String> = store.tables().map(|t| t.config().name.clone()).collect();
                for name in names {
                    let kept = seen.get(&name);
                    let gone = store.keys_where(&writing, &name, |k| {
                        shard_for_key(k, source_shards) == shard
                            && !kept.is_some_and(|kept| kept.contains(&k))
                    });
                    removed += store.remove_rows(&writing, &name, &gone).unwrap_or(0);
                }
            }
            removed
        })
        .await
        .map_err(FeedError::Task)?;
        if removed > 0 {
            tracing::info!(
                source_shard = shard,
                removed,
                "removed rows the training shard no longer has"
            );
        }
        *session = 0;
        Ok((mark.unwrap_or_default(), rows))
    }

    fn client(&self, addr: &str) -> Option<DeltaClient> {
        let transport = self.transport.locked().clone()?;
        Some(
            self.clients
                .locked()
                .entry(addr.to_owned())
                .or_insert_with(|| {
                    DeltaClient::new(Channel::with_transport(
                        addr,
                        ChannelConfig {
                            connect_timeout_ms: 1000,
                            request_timeout_ms: 30_000,
                            ..ChannelConfig::default()
                        },
                        transport,
                    ))
                })
                .clone(),
        )
    }
}
