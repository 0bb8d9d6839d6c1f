//! Recovery: a server becoming the primary of a shard first makes its
//! copy the freshest one there is.
//!
//! It asks every other server of the shard what it holds (`ShardStatus`:
//! version, newest epoch heard of, the old primary's last head), and when
//! one holds a newer copy than its own, copies it (a `Sync` without
//! attaching). Only then does it take Pushes. In static mode it waits for
//! every configured replica to answer, however long that takes, because
//! one that is down might hold the freshest copy and nothing else could
//! tell; with a coordinator it waits for the live members (those holding
//! a lease) for a bounded time.
//!
//! The Pushes a failover loses (`ack = "primary"`) are estimated here: the
//! old primary's head as its replicas last heard it, less the position of
//! the copy the new primary starts from.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_proto::v1::{ShardStatusRequest, ShardStatusResponse};

use super::Replication;
use super::shard::Role;

/// The longest one `ShardStatus` call of a recovery may take: a server
/// that does not answer within it is asked again (static mode) or left
/// out (with a coordinator, once the patience runs out).
const STATUS_TIMEOUT: Duration = Duration::from_secs(2);
use super::sync::CopyError;
use tessera_store::version::Version;

/// How long a recovery waits for the other servers of the shard.
#[derive(Debug, Clone)]
pub enum Patience {
    /// Until every one of them has answered (static mode).
    All,
    /// Until every one has answered or `Instant` passes; those that did
    /// not answer by then are left out (with a coordinator: live members
    /// only, so one that does not answer is partitioned or dying).
    Until(Instant),
}

/// What a recovery found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The version this server holds now.
    pub version: Version,
    /// The newest epoch any server of the shard has seen (a static
    /// primary takes the next one).
    pub newest_epoch: u64,
    /// The server it copied from, when another held a newer copy.
    pub copied_from: Option<String>,
    /// Pushes the old primary had applied beyond the copy it starts from,
    /// as far as its replicas heard (lost with `ack = "primary"`).
    pub lost: u64,
    /// Servers that did not answer in time.
    pub silent: Vec<String>,
}

/// Why a recovery or a takeover failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// The shard is not hosted here.
    #[error("shard {0} is not hosted here")]
    NotHosted(u32),
    /// A newer epoch than the one to take over with is known.
    #[error("shard {shard} has a newer primary (epoch {known})")]
    Superseded {
        /// The shard.
        shard: u32,
        /// The newest epoch known.
        known: u64,
    },
    /// The freshest copy could not be copied.
    #[error("copying shard {shard} from {from}: {source}")]
    Copy {
        /// The shard.
        shard: u32,
        /// The server with the freshest copy.
        from: String,
        /// Why.
        source: CopyError,
    },
    /// No copy known to hold every acknowledged Push (the shard's in-step
    /// record, `in_step`) is here or answered, and not every server of
    /// the shard answered: leading from what answered could lose
    /// acknowledged Pushes.
    #[error(
        "shard {shard}: no copy listed in step at epoch {epoch} ({members:?}) is here or answered; waiting for one"
    )]
    NoCopyInStep {
        /// The shard.
        shard: u32,
        /// The record's epoch.
        epoch: u64,
        /// The copies it lists.
        members: Vec<String>,
    },
    /// The server stopped.
    #[error("stopped")]
    Stopped,
}

impl Replication {
    /// Makes this server's copy of `shard` the freshest among `servers`
    /// (module docs). The shard must be recovering
    /// ([`Replication::begin_recovery`]). With the shard's in-step record
    /// (`in_step`), a copy it says holds every acknowledged Push must be
    /// this server's or among those that answered, unless every server of
    /// the shard answered.
    pub async fn recover(
        self: &Arc<Self>,
        shard: u32,
        servers: &[String],
        patience: Patience,
        in_step: Option<&tessera_coord::InStepRecord>,
    ) -> Result<Recovered, RecoveryError> {
        let started = Instant::now();
        let recovering = self.cell(shard).and_then(|c| match c.lock().role {
            Role::Recovering { epoch } => Some(epoch),
            _ => None,
        });
        let Some(recovering) = recovering else {
            return Err(RecoveryError::Superseded {
                shard,
                known: self.known_epoch(shard),
            });
        };
        let statuses = self.ask_all(shard, servers, &patience).await?;
        let own = self
            .store
            .version(shard)
            .ok_or(RecoveryError::NotHosted(shard))?;
        if let Some(record) = in_step {
            let mine = self.in_step_epoch(shard);
            let held = super::in_step::eligible(record, &self.me, mine)
                || statuses
                    .iter()
                    .any(|(addr, s)| super::in_step::eligible(record, addr, s.in_step_epoch));
            let everyone = self
                .peers_of(shard)
                .iter()
                .all(|peer| statuses.contains_key(peer));
            if !held && !everyone {
                return Err(RecoveryError::NoCopyInStep {
                    shard,
                    epoch: record.epoch,
                    members: record.members.clone(),
                });
            }
            if !held {
                tracing::warn!(shard, epoch = record.epoch, members = ?record.members, "no copy listed in step survives; every server of the shard answered, so the freshest of them leads");
            }
        }
        let mut newest_epoch = own.epoch.max(self.known_epoch(shard));
        let mut best: Option<(&String, Version)> = None;
        for (addr, status) in &statuses {
            let version = crate::wire::version_from_wire(status.version.unwrap_or_default());
            newest_epoch = newest_epoch.max(status.known_epoch).max(version.epoch);
            if status.hosted && best.is_none_or(|(_, v)| version > v) {
                best = Some((addr, version));
            }
        }
        let mut copied_from = None;
        let mut version = own;
        if let Some((from, offered)) = best
            && offered > own
        {
            version = Arc::clone(self)
                .copy_from(shard, recovering, from, own)
                .await
                .map_err(|source| RecoveryError::Copy {
                    shard,
                    from: from.clone(),
                    source,
                })?;
            copied_from = Some(from.clone());
        }
        // How far the old primary had got, as its replicas last heard.
        let lost = statuses
            .values()
            .filter_map(|s| s.primary_head)
            .map(crate::wire::version_from_wire)
            .filter(|head| head.epoch >= version.epoch)
            .map(|head| head.position.saturating_sub(version.position))
            .max()
            .unwrap_or(0);
        let silent: Vec<String> = servers
            .iter()
            .filter(|s| !statuses.contains_key(*s))
            .cloned()
            .collect();
        tracing::info!(shard, %version, own = %own, copied_from = ?copied_from, lost, silent = ?silent, took = ?started.elapsed(), "recovered the freshest copy of the shard");
        Ok(Recovered {
            version,
            newest_epoch,
            copied_from,
            lost,
            silent,
        })
    }

    async fn ask_all(
        &self,
        shard: u32,
        servers: &[String],
        patience: &Patience,
    ) -> Result<HashMap<String, ShardStatusResponse>, RecoveryError> {
        let mut answers = HashMap::new();
        let mut backoff = Duration::from_millis(20);
        let mut last_log = Instant::now();
        loop {
            // Every one still to answer at once, each call bounded, so that
            // one hanging server cannot hold the others' answers back.
            let bound = match patience {
                Patience::All => STATUS_TIMEOUT,
                Patience::Until(deadline) => deadline
                    .saturating_duration_since(Instant::now())
                    .clamp(Duration::from_millis(1), STATUS_TIMEOUT),
            };
            let options = tessera_rpc::CallOptions::with_timeout(bound);
            let asks = servers
                .iter()
                .filter(|addr| !answers.contains_key(*addr))
                .filter_map(|addr| Some((addr, self.client(addr)?)))
                .map(|(addr, client)| {
                    let options = &options;
                    async move {
                        let answer = client
                            .shard_status_with_options(ShardStatusRequest { shard }, options)
                            .await;
                        (addr, answer)
                    }
                });
            for (addr, answer) in futures::future::join_all(asks).await {
                if let Ok(status) = answer {
                    answers.insert(addr.clone(), status);
                }
            }
            let waiting: Vec<&String> = servers
                .iter()
                .filter(|s| !answers.contains_key(*s) && self.client(s).is_some())
                .collect();
            if waiting.is_empty() {
                return Ok(answers);
            }
            if let Patience::Until(deadline) = patience
                && Instant::now() >= *deadline
            {
                return Ok(answers);
            }
            if last_log.elapsed() >= Duration::from_secs(5) {
                tracing::warn!(shard, waiting = ?waiting, "recovering the shard: waiting for these servers to answer before taking Pushes (static mode cannot tell whether one of them holds the freshest copy)");
                last_log = Instant::now();
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = self.stop.cancelled() => return Err(RecoveryError::Stopped),
            }
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Copies `shard` from `from` (which holds a newer copy than `own`),
    /// for the recovery under `epoch` (installed off the async threads; a
    /// recovery that was overtaken installs nothing).
    async fn copy_from(
        self: Arc<Self>,
        shard: u32,
        epoch: u64,
        from: &str,
        own: Version,
    ) -> Result<Version, CopyError> {
        let mut fetched = self.fetch_copy(shard, from, own, false).await?;
        let Some(copy) = fetched.copy.take() else {
            if let Some(writing) = self.store.lock_shard_async(shard).await {
                fetched.keep_origins(&self.store, &writing);
            }
            return Ok(own);
        };
        let bytes = copy.bytes;
        let from = from.to_owned();
        tokio::task::spawn_blocking(move || {
            let (Some(cell), Some(mut writing)) = (self.cell(shard), self.store.lock_shard(shard))
            else {
                return Err(CopyError::Superseded);
            };
            let state = cell.lock();
            if state.role != (Role::Recovering { epoch }) {
                return Err(CopyError::Superseded);
            }
            if fetched.version < writing.version() {
                return Err(CopyError::Older {
                    offered: fetched.version,
                    own: writing.version(),
                });
            }
            let (rows, old_rows) = copy.install(&self.store, &writing, Instant::now());
            writing.set_version(fetched.version);
            fetched.keep_origins(&self.store, &writing);
            drop(state);
            drop(writing);
            drop(old_rows);
            self.syncs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            metrics::counter!("tessera_ps_replication_syncs_total").increment(1);
            tracing::info!(shard, from, version = %fetched.version, rows, bytes, "copied the freshest copy of the shard");
            Ok(fetched.version)
        })
        .await
        .map_err(|_| CopyError::Superseded)?
    }
}
