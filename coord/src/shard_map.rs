//! The shard map of a cluster and its resizes (issue 39): how many shards
//! the keys are spread over, under a version that only grows, and a
//! resize from `n` to `m` shards as a state machine stored with it in one
//! etcd key, so that it survives the restart of any participant, the one
//! that started it included.
//!
//! ```text
//!            plan(m)            every new shard ready        cut_over done
//!   (none) ─────────> Planned ─> Copying ───────────────> CutOver ─────────> Done
//!                        │          │                        │
//!                        └──────────┴── cancel ──> Cancelled ┘ (the map is n again;
//!                                                    after the cut-over only while
//!                                                    no receiving shard claimed its
//!                                                    opening)
//! ```
//!
//! - **Planned**: the operator (`tessera reshard --to M`) wrote the plan;
//!   nothing moved yet.
//! - **Copying**: the servers of the shards that receive keys copy the
//!   moving keys from their current owners and follow those owners'
//!   streams; each reports ready ([`ShardMap::handle_ready`]) once in step.
//!   A shard that falls out of step reports not ready again.
//! - **CutOver**: every receiving shard is ready; one coordinator
//!   transaction (this record, compared on its revision) moves ownership
//!   to the new count under a new version: old owners refuse the moved
//!   keys from then on and redirect.
//! - **Done** / **Cancelled**: the resize is over; a new one may be
//!   planned. Cancelling is allowed before the cut-over, and after it
//!   while no receiving shard claimed its opening ([`ShardMap::handle_opening`]):
//!   the way out of a resize that one giving shard cannot finish (down
//!   with no replica, cut off from a receiving shard), since no
//!   receiving shard opens without every giving shard's fenced delta.
//!   It is safe: a receiving primary opens only after its claim is
//!   written, compared on the revision it read, so a cancel and an
//!   opening cannot both win; until a shard opens, no copy of any
//!   receiving shard has taken a Push of a moved key (it serves none),
//!   and no worker routes by the new count (it waits for every opening);
//!   the giving shards refused the moved keys since their fence, so
//!   their rows are the truth, and lifting the fence resumes them where
//!   they stopped. Once a claim is written the resize can only finish.
//!
//! This module is sans-IO: each transition takes the record and returns
//! the next, or says why not; the caller writes it with a compare on the
//! revision it read (`EtcdCoordinator::write_shard_map`), so that two
//! participants acting on the same state cannot both win.
//!
//! Which keys move is the jump consistent hash's
//! (`tessera_proto::sharding::shard_for_key`): growing from `n` to `m`,
//! keys move only into the new shards `n..m`; shrinking, only out of the
//! shards `m..n`.
//!
//! ## How rows move
//!
//! Built: this record and its transitions, the operator's tool
//! (`tessera reshard`, with `--hold` and `--cut-over`), servers that
//! refuse a count the map does not name and follow the map through a
//! watch of its key (`EtcdCoordinator::follow_shard_map`, reported in
//! Health and `tessera status`), growing through the cut-over
//! (`ps-server/src/reshard.rs`) to done (once every receiving shard
//! opened; the old owners then drop the moved rows), and workers that
//! follow the map (`worker/src/routing.rs`); once a growth is done the
//! old shards' servers route by its count, so another can follow; and
//! shrinking, the same way with the differences below.
//!
//! - **Copy and follow through the delta stream, not the replication
//!   stream.** A receiving shard's primary copies the moving keys from
//!   each giving shard's primary with the delta stream's paged, filtered
//!   copy (routed by the target count), optimizer state, step counts and
//!   expiry stamps included, then follows that primary's delta stream for
//!   them. The replication stream was weighed and set aside: its
//!   replicas are configured peers of the same shard id, its copy is a
//!   whole-shard byte range swapped in whole, and its forwarded Pushes
//!   carry per-request indices (evictions, admissions) that a key filter
//!   would have to re-base; the delta stream is state-based (rows as they
//!   are now), idempotent, routed by key and recovers a gap by copying.
//!   Every copy of a receiving shard refuses Fetches and Pushes meanwhile.
//! - **Cut-over.** Once every receiving shard reports ready (in step
//!   within a delta) and the operator does not hold it, a receiving
//!   primary writes `CutOver` with the new count (one compare-and-swap:
//!   a shard that fell out of step meanwhile wrote `ready` again, and the
//!   write loses). Every copy of a giving shard, seeing it, fences the
//!   moving keys under its shard lock: their Pushes are refused with a
//!   `KeysMoved` naming the count (a replica still applies what its
//!   primary forwarded), and their Fetches once every receiving shard
//!   serves (until then nobody writes them, and the old shard serves
//!   them). The giving primary's cuts from then on
//!   are marked fenced, and so are copies taken after the fence, so a
//!   receiver that lost a delta and copies still knows it is complete.
//!   A receiving primary that applied every giving shard's fenced delta
//!   (or copy) opens its shard: its feed closes, the shard takes a stream
//!   position as a gap, which cuts its replicas off so that they copy the
//!   shard from it, and it serves; it records the position in `opened`.
//!   A copy of a receiving shard serves only once it holds that position
//!   (a replica that copied the opened primary, or was promoted from
//!   one). The giving shards stop streaming to opened shards. Only the
//!   moving keys pause, from the fence for about one delta interval.
//!   Removals at a giving shard between the fence and the opening
//!   (evictions, expiry) reach the receiving shard with the fenced deltas.
//! - **Exactly once.** A worker's Push id is shared by its per-shard
//!   parts, and a Push names the count it was split by. A giving shard
//!   takes parts split by the new count only once every receiving shard
//!   opened, so until then its deduplication windows name only Pushes
//!   split by the old count, each of whose parts held all its keys of the
//!   shard, moving ones included. Its fenced deltas carry those windows;
//!   the receiving primary keeps them per giving shard and leaves out of
//!   a retried part the keys whose giving shard applied it. A part
//!   applied at one giving shard does not make its sibling from another
//!   giving shard look applied.
//! - **Workers** follow the same key and, once every receiving shard
//!   serves, read the new shards' servers from etcd and split by the new
//!   count; a `KeysMoved` makes a request wait for that and go again,
//!   split anew.
//! - **Done**: the old owners drop the moved rows and route by the new
//!   count from then on (the fence stays and widens with a later
//!   growth), so another resize can follow.
//! - **Restarts.** A server of the old count may start after the
//!   cut-over (it keeps its shard id and the keys that stayed); every
//!   server sets the fence and its receiving shards from the map before
//!   it serves.
//!
//! **Shrinking** from `n` to `m` moves every key of shards `m..n` into
//! shards `0..m`, whose own keys stay. So the receiving shards are
//! servers of the old count that keep serving their own keys: a copy of
//! one refuses only the keys it receives (and Pushes split by `m`) until
//! it opens; the giving shards are fenced whole at the cut-over. A
//! receiving shard's own deduplication window named Pushes split by `n`
//! until its opening, when it is kept as one more origin window (the
//! shard itself) and a new one starts; from then on the shard takes only
//! parts split by `m` (one split by `n` is answered `KeysMoved`, and the
//! worker splits the Push anew), so a retried part leaves out the keys
//! whose old shard, itself included, applied it, and the new window
//! catches a second retry. Once done, the giving shards drop their rows
//! and their servers are stopped; a cancel drops the rows the receiving
//! shards took.
//!
//! The giving shards' windows travel with every copy of the receiving
//! shard (a replica's, a recovering primary's: `SyncResponse.origins`,
//! tagged with the resize), so a part retried across the cut-over is
//! applied once whichever copy leads, one that copied an opened primary
//! opening again with them as they are. A server that wins a shard's
//! lead takes no Push until its fence and receiving states were set from
//! the map it read after the win (`ps-server/src/coordination/etcd_driver.rs`). Known limits: checkpoints do not hold them (a receiving shard
//! restarted from its checkpoint within a Push timeout of its opening may
//! apply such a part twice); a worker still on the old count may read a
//! moved key's older value at an old copy for at most the in-step bound
//! after that copy fenced (`Store::moved_reads_over`; as at a replica);
//! a server configured with a count two resizes back is refused at its
//! start (checkpoints record the count a server routes by, and load
//! under another configured count in etcd mode); a
//! receiving primary that dies after opening, before any replica copied
//! it, leaves the shard to a copy that cannot serve until an operator
//! intervenes.

use serde::{Deserialize, Serialize};

/// The most shards a resize may target.
pub const MAX_SHARDS: u32 = 1 << 16;

/// The cluster's shard map, as stored (JSON) in its shard-map key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMap {
    /// Grows by one with every change (a plan, a step of a resize): what
    /// workers and servers compare to know they hold the latest.
    pub version: u64,
    /// The shard count keys are routed by now.
    pub num_shards: u32,
    /// The resize in progress or last finished, if any.
    pub resize: Option<Resize>,
}

/// One resize of the shard count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resize {
    /// The map version that planned it (names the resize).
    pub id: u64,
    /// The shard count before it.
    pub from: u32,
    /// The shard count after it.
    pub to: u32,
    /// Where it stands.
    pub state: ResizeState,
    /// The receiving shards in step with the keys they receive (while
    /// copying), sorted.
    pub ready: Vec<u32>,
    /// The operator holds the cut-over ([`ShardMap::plan_held`]) until
    /// [`ShardMap::release`]: the receiving shards copy and follow, and
    /// stay in step, but ownership does not move.
    #[serde(default)]
    pub hold: bool,
    /// The receiving shards whose primary serves the moved keys (after
    /// the cut-over), each with the stream position it opened at: the
    /// giving shards stop streaming to them, and a copy of the shard
    /// serves only once it holds that position (it copied the opened
    /// primary's rows).
    #[serde(default)]
    pub opened: std::collections::BTreeMap<u32, u64>,
    /// The receiving shards whose primary claimed the opening (after the
    /// cut-over, before it opens the shard): a cancel is refused from the
    /// first claim on (module docs).
    #[serde(default)]
    pub opening: std::collections::BTreeSet<u32>,
}

/// Where a resize stands (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeState {
    /// Written; nothing moved yet.
    Planned,
    /// Receiving shards copy and follow the moving keys.
    Copying,
    /// Ownership moved to the new count.
    CutOver,
    /// Finished: the old owners dropped the moved keys.
    Done,
    /// Given up (before the cut-over, or after it while no receiving
    /// shard claimed its opening): the map is as it was.
    Cancelled,
}

/// Why a transition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    /// A resize is in progress already.
    #[error("a resize from {from} to {to} shards is in progress ({state:?})")]
    InProgress {
        /// Its shard counts.
        from: u32,
        /// See `from`.
        to: u32,
        /// Where it stands.
        state: ResizeState,
    },
    /// The target is the count already, zero, or beyond [`MAX_SHARDS`].
    #[error("cannot resize {from} shards to {to}")]
    BadTarget {
        /// The count now.
        from: u32,
        /// The target.
        to: u32,
    },
    /// No resize is in progress.
    #[error("no resize is in progress")]
    NoResize,
    /// The transition does not apply in this state.
    #[error("a resize that is {state:?} cannot {action}")]
    WrongState {
        /// Where it stands.
        state: ResizeState,
        /// What was asked.
        action: &'static str,
    },
    /// The shard does not receive keys in this resize.
    #[error("shard {shard} receives no keys when {from} shards become {to}")]
    NotReceiving {
        /// The shard.
        shard: u32,
        /// The resize's counts.
        from: u32,
        /// See `from`.
        to: u32,
    },
    /// Not every receiving shard is ready.
    #[error("shards {missing:?} are not in step with the keys they receive yet")]
    NotReady {
        /// The receiving shards not ready.
        missing: Vec<u32>,
    },
    /// The operator holds the cut-over.
    #[error("the operator holds the cut-over (`tessera reshard --cut-over` releases it)")]
    Held,
    /// Not every receiving shard serves its moved keys yet.
    #[error("shards {missing:?} do not serve the keys they received yet")]
    NotOpened {
        /// The receiving shards not opened.
        missing: Vec<u32>,
    },
    /// Receiving shards claimed their opening: the resize can only
    /// finish.
    #[error("shards {shards:?} are opening or opened: the resize can only finish now")]
    Opening {
        /// The receiving shards that claimed their opening.
        shards: Vec<u32>,
    },
}

impl ShardMap {
    /// The map of a cluster created with `num_shards` shards (version 1,
    /// no resize).
    pub fn new(num_shards: u32) -> Self {
        Self {
            version: 1,
            num_shards,
            resize: None,
        }
    }

    /// The resize in progress (not done or cancelled), if any.
    pub fn active(&self) -> Option<&Resize> {
        self.resize
            .as_ref()
            .filter(|r| !matches!(r.state, ResizeState::Done | ResizeState::Cancelled))
    }

    /// Plans a resize to `to` shards whose cut-over waits for the
    /// operator's [`ShardMap::release`] (`tessera reshard --to M --hold`):
    /// for a cut-over at a chosen moment, after checking the new servers.
    pub fn plan_held(&self, to: u32) -> Result<Self, ResizeError> {
        let mut next = self.plan(to)?;
        if let Some(r) = &mut next.resize {
            r.hold = true;
        }
        Ok(next)
    }

    /// Lets a held resize cut over once every receiving shard is ready.
    pub fn release(&self) -> Result<Self, ResizeError> {
        self.step(
            "be released",
            &[ResizeState::Planned, ResizeState::Copying],
            |r| {
                r.hold = false;
                Ok(())
            },
        )
    }

    /// Plans a resize to `to` shards.
    pub fn plan(&self, to: u32) -> Result<Self, ResizeError> {
        if let Some(r) = self.active() {
            return Err(ResizeError::InProgress {
                from: r.from,
                to: r.to,
                state: r.state,
            });
        }
        if to == 0 || to == self.num_shards || to > MAX_SHARDS {
            return Err(ResizeError::BadTarget {
                from: self.num_shards,
                to,
            });
        }
        let version = self.version + 1;
        Ok(Self {
            version,
            num_shards: self.num_shards,
            resize: Some(Resize {
                id: version,
                from: self.num_shards,
                to,
                state: ResizeState::Planned,
                ready: Vec::new(),
                hold: false,
                opened: Default::default(),
                opening: Default::default(),
            }),
        })
    }

    /// The receiving shards have started copying.
    pub fn start_copying(&self) -> Result<Self, ResizeError> {
        self.step("start copying", &[ResizeState::Planned], |r| {
            r.state = ResizeState::Copying;
            Ok(())
        })
    }

    /// Receiving shard `shard` is in step with the keys it receives
    /// (`ready`), or fell out of step (`!ready`).
    pub fn handle_ready(&self, shard: u32, ready: bool) -> Result<Self, ResizeError> {
        self.step("report a shard ready", &[ResizeState::Copying], |r| {
            if !r.receiving().any(|s| s == shard) {
                return Err(ResizeError::NotReceiving {
                    shard,
                    from: r.from,
                    to: r.to,
                });
            }
            match (ready, r.ready.binary_search(&shard)) {
                (true, Err(at)) => r.ready.insert(at, shard),
                (false, Ok(at)) => {
                    r.ready.remove(at);
                }
                _ => {}
            }
            Ok(())
        })
    }

    /// Moves ownership to the new count: every receiving shard must be
    /// ready, and the cut-over not held.
    pub fn cut_over(&self) -> Result<Self, ResizeError> {
        let mut next = self.step("cut over", &[ResizeState::Copying], |r| {
            if r.hold {
                return Err(ResizeError::Held);
            }
            let missing: Vec<u32> = r
                .receiving()
                .filter(|s| r.ready.binary_search(s).is_err())
                .collect();
            if !missing.is_empty() {
                return Err(ResizeError::NotReady { missing });
            }
            r.state = ResizeState::CutOver;
            Ok(())
        })?;
        if let Some(r) = &next.resize {
            next.num_shards = r.to;
        }
        Ok(next)
    }

    /// Receiving shard `shard`'s primary holds every moved key and serves
    /// them (after the cut-over), from stream position `position` on.
    pub fn handle_opened(&self, shard: u32, position: u64) -> Result<Self, ResizeError> {
        self.step("report a shard opened", &[ResizeState::CutOver], |r| {
            if !r.receiving().any(|s| s == shard) {
                return Err(ResizeError::NotReceiving {
                    shard,
                    from: r.from,
                    to: r.to,
                });
            }
            if r.opened.contains_key(&shard) {
                return Err(ResizeError::WrongState {
                    state: r.state,
                    action: "report a shard opened twice",
                });
            }
            r.opened.insert(shard, position);
            Ok(())
        })
    }

    /// Every receiving shard serves its moved keys: the resize is done,
    /// and the old owners drop the moved rows.
    pub fn finish(&self) -> Result<Self, ResizeError> {
        self.step("finish", &[ResizeState::CutOver], |r| {
            let missing: Vec<u32> = r
                .receiving()
                .filter(|s| !r.opened.contains_key(s))
                .collect();
            if !missing.is_empty() {
                return Err(ResizeError::NotOpened { missing });
            }
            r.state = ResizeState::Done;
            Ok(())
        })
    }

    /// Receiving shard `shard`'s primary is about to open it (after the
    /// cut-over): from now on the resize can only finish. Claiming again
    /// changes nothing.
    pub fn handle_opening(&self, shard: u32) -> Result<Self, ResizeError> {
        self.step("claim a shard's opening", &[ResizeState::CutOver], |r| {
            if !r.receiving().any(|s| s == shard) {
                return Err(ResizeError::NotReceiving {
                    shard,
                    from: r.from,
                    to: r.to,
                });
            }
            r.opening.insert(shard);
            Ok(())
        })
    }

    /// Gives the resize up: the map routes by the count before it. Before
    /// the cut-over always; after it while no receiving shard claimed its
    /// opening (module docs: the giving shards lift their fence).
    pub fn cancel(&self) -> Result<Self, ResizeError> {
        let mut next = self.step(
            "be cancelled",
            &[
                ResizeState::Planned,
                ResizeState::Copying,
                ResizeState::CutOver,
            ],
            |r| {
                let claimed: std::collections::BTreeSet<u32> =
                    r.opening.iter().chain(r.opened.keys()).copied().collect();
                if !claimed.is_empty() {
                    return Err(ResizeError::Opening {
                        shards: claimed.into_iter().collect(),
                    });
                }
                r.state = ResizeState::Cancelled;
                r.ready.clear();
                Ok(())
            },
        )?;
        if let Some(r) = &next.resize {
            next.num_shards = r.from;
        }
        Ok(next)
    }

    /// The next map: the active resize changed by `change`, allowed only
    /// in `states`; the version one up.
    fn step(
        &self,
        action: &'static str,
        states: &[ResizeState],
        change: impl FnOnce(&mut Resize) -> Result<(), ResizeError>,
    ) -> Result<Self, ResizeError> {
        let mut resize = self.active().cloned().ok_or(ResizeError::NoResize)?;
        if !states.contains(&resize.state) {
            return Err(ResizeError::WrongState {
                state: resize.state,
                action,
            });
        }
        change(&mut resize)?;
        Ok(Self {
            version: self.version + 1,
            num_shards: self.num_shards,
            resize: Some(resize),
        })
    }
}

impl Resize {
    /// The shards that receive keys: the new ones when growing, the
    /// remaining ones when shrinking (jump hashing moves keys only there).
    pub fn receiving(&self) -> impl Iterator<Item = u32> {
        if self.to > self.from {
            self.from..self.to
        } else {
            0..self.to
        }
    }

    /// The shards that give keys away: every old shard when growing, the
    /// removed ones when shrinking.
    pub fn giving(&self) -> impl Iterator<Item = u32> {
        if self.to > self.from {
            0..self.from
        } else {
            self.to..self.from
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resize_goes_planned_copying_cut_over_done() {
        let map = ShardMap::new(2);
        let planned = map.plan(4).unwrap();
        assert_eq!(planned.version, 2);
        assert_eq!(
            planned.num_shards, 2,
            "routing changes only at the cut-over"
        );
        let copying = planned.start_copying().unwrap();
        let r = copying.active().unwrap();
        assert_eq!(r.receiving().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(r.giving().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(
            copying.cut_over().unwrap_err(),
            ResizeError::NotReady {
                missing: vec![2, 3]
            }
        );
        let one = copying.handle_ready(3, true).unwrap();
        assert!(matches!(
            one.handle_ready(1, true),
            Err(ResizeError::NotReceiving { shard: 1, .. })
        ));
        // A shard that falls out of step is not ready again.
        let both = one
            .handle_ready(2, true)
            .unwrap()
            .handle_ready(3, false)
            .unwrap();
        assert_eq!(both.active().unwrap().ready, vec![2]);
        let both = both.handle_ready(3, true).unwrap();
        assert!(
            both.handle_opened(2, 1).is_err(),
            "opened before the cut-over"
        );
        let cut = both.cut_over().unwrap();
        assert_eq!(cut.num_shards, 4);
        let cut = cut
            .handle_opened(3, 1)
            .unwrap()
            .handle_opened(2, 5)
            .unwrap();
        assert_eq!(
            cut.active().unwrap().opened.iter().collect::<Vec<_>>(),
            [(&2, &5), (&3, &1)]
        );
        assert!(cut.handle_opened(2, 6).is_err(), "opened twice");
        assert!(matches!(
            cut.handle_opened(1, 1),
            Err(ResizeError::NotReceiving { shard: 1, .. })
        ));
        let half = both.cut_over().unwrap().handle_opened(3, 1).unwrap();
        assert_eq!(
            half.finish().unwrap_err(),
            ResizeError::NotOpened { missing: vec![2] }
        );
        assert_eq!(
            cut.cancel().unwrap_err(),
            ResizeError::Opening { shards: vec![2, 3] }
        );
        let done = cut.finish().unwrap();
        assert!(done.active().is_none());
        assert_eq!(done.num_shards, 4);
        // Another may be planned now: back down to 3.
        let down = done.plan(3).unwrap();
        let r = down.active().unwrap();
        assert_eq!(r.receiving().collect::<Vec<_>>(), vec![0, 1, 2]);
        assert_eq!(r.giving().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn cancelling_before_the_cut_over_leaves_the_map_as_it_was() {
        let map = ShardMap::new(3);
        for at in 0..2 {
            let mut resizing = map.plan(5).unwrap();
            if at == 1 {
                resizing = resizing
                    .start_copying()
                    .unwrap()
                    .handle_ready(4, true)
                    .unwrap();
            }
            let cancelled = resizing.cancel().unwrap();
            assert_eq!(cancelled.num_shards, 3);
            assert!(cancelled.active().is_none());
            assert!(cancelled.version > resizing.version);
            assert!(cancelled.plan(4).is_ok());
        }
    }

    #[test]
    fn bad_plans_and_steps_are_refused() {
        let map = ShardMap::new(2);
        for to in [0, 2, MAX_SHARDS + 1] {
            assert!(matches!(map.plan(to), Err(ResizeError::BadTarget { .. })));
        }
        assert_eq!(map.finish().unwrap_err(), ResizeError::NoResize);
        let planned = map.plan(3).unwrap();
        assert!(matches!(
            planned.plan(4),
            Err(ResizeError::InProgress { from: 2, to: 3, .. })
        ));
        assert!(matches!(
            planned.cut_over(),
            Err(ResizeError::WrongState {
                state: ResizeState::Planned,
                ..
            })
        ));
    }

    #[test]
    fn a_held_resize_cuts_over_only_once_released() {
        let ready = ShardMap::new(2)
            .plan_held(3)
            .unwrap()
            .start_copying()
            .unwrap()
            .handle_ready(2, true)
            .unwrap();
        assert!(ready.active().unwrap().hold);
        assert_eq!(ready.cut_over().unwrap_err(), ResizeError::Held);
        let released = ready.release().unwrap();
        assert_eq!(released.cut_over().unwrap().num_shards, 3);
        // A record written before `hold` existed reads as not held.
        let old = r#"{"version":3,"num_shards":2,"resize":{"id":2,"from":2,"to":3,"state":"copying","ready":[]}}"#;
        let map: ShardMap = serde_json::from_str(old).unwrap();
        assert!(!map.active().unwrap().hold);
    }

    #[test]
    fn a_cut_over_resize_is_cancelled_until_a_receiving_shard_claims_its_opening() {
        let cut = ShardMap::new(2)
            .plan(3)
            .unwrap()
            .start_copying()
            .unwrap()
            .handle_ready(2, true)
            .unwrap()
            .cut_over()
            .unwrap();
        assert_eq!(cut.num_shards, 3);
        // No shard claimed: the way out, back to 2.
        let back = cut.cancel().unwrap();
        assert_eq!(back.num_shards, 2);
        assert_eq!(back.resize.as_ref().unwrap().state, ResizeState::Cancelled);
        assert!(back.active().is_none());
        // Claimed: it can only finish.
        let claimed = cut.handle_opening(2).unwrap();
        assert_eq!(
            claimed.handle_opening(2).unwrap().active(),
            claimed.active()
        );
        assert!(matches!(
            claimed.handle_opening(0),
            Err(ResizeError::NotReceiving { shard: 0, .. })
        ));
        assert_eq!(
            claimed.cancel().unwrap_err(),
            ResizeError::Opening { shards: vec![2] }
        );
        // Cancelled, a claim is refused (a receiving primary that read the
        // cut-over before the cancel does not open).
        assert!(matches!(
            back.handle_opening(2),
            Err(ResizeError::NoResize | ResizeError::WrongState { .. })
        ));
        // A map written before the claims existed reads as none claimed.
        let text = serde_json::to_string(&cut)
            .unwrap()
            .replace(",\"opening\":[]", "");
        assert!(!text.contains("opening"), "{text}");
        assert_eq!(serde_json::from_str::<ShardMap>(&text).unwrap(), cut);
    }

    #[test]
    fn the_record_round_trips_as_json() {
        let map = ShardMap::new(2).plan(3).unwrap().start_copying().unwrap();
        let text = serde_json::to_string(&map).unwrap();
        assert!(text.contains("\"copying\""), "{text}");
        assert_eq!(serde_json::from_str::<ShardMap>(&text).unwrap(), map);
    }

    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Plan(u32),
        Start,
        Ready(u32, bool),
        CutOver,
        Finish,
        Cancel,
        Hold(u32),
        Release,
        Opened(u32),
        Opening(u32),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0u32..8).prop_map(Step::Plan),
            Just(Step::Start),
            (0u32..8, any::<bool>()).prop_map(|(s, r)| Step::Ready(s, r)),
            Just(Step::CutOver),
            Just(Step::Finish),
            Just(Step::Cancel),
            (0u32..8).prop_map(Step::Hold),
            Just(Step::Release),
            (0u32..8).prop_map(Step::Opened),
            (0u32..8).prop_map(Step::Opening),
        ]
    }

    proptest! {
        /// Whatever is asked in whatever order: every accepted step raises
        /// the version by one; the routed count changes only at a cut-over,
        /// to the resize's target, after every receiving shard was ready;
        /// a cancelled resize leaves the count it found; `ready` holds only
        /// receiving shards, sorted.
        #[test]
        fn every_accepted_step_keeps_the_map_sound(steps in proptest::collection::vec(step(), 1..60)) {
            let mut map = ShardMap::new(3);
            for s in steps {
                let next = match s {
                    Step::Plan(to) => map.plan(to),
                    Step::Start => map.start_copying(),
                    Step::Ready(shard, ready) => map.handle_ready(shard, ready),
                    Step::CutOver => map.cut_over(),
                    Step::Finish => map.finish(),
                    Step::Cancel => map.cancel(),
                    Step::Hold(to) => map.plan_held(to),
                    Step::Release => map.release(),
                    Step::Opened(shard) => map.handle_opened(shard, 1),
                    Step::Opening(shard) => map.handle_opening(shard),
                };
                let Ok(next) = next else { continue };
                prop_assert_eq!(next.version, map.version + 1);
                if next.num_shards != map.num_shards {
                    let r = next.resize.as_ref().unwrap();
                    let before = map.active().unwrap();
                    if r.state == ResizeState::Cancelled {
                        // A cancel after the cut-over, before any claim.
                        prop_assert_eq!(before.state, ResizeState::CutOver);
                        prop_assert_eq!(next.num_shards, r.from);
                        prop_assert!(before.opening.is_empty() && before.opened.is_empty());
                    } else {
                        prop_assert_eq!(r.state, ResizeState::CutOver);
                        prop_assert_eq!(next.num_shards, r.to);
                        prop_assert!(before.receiving().all(|s| before.ready.contains(&s)));
                        prop_assert!(!before.hold, "a held resize cut over");
                    }
                }
                if let Some(r) = &next.resize {
                    prop_assert!(r.ready.windows(2).all(|w| w[0] < w[1]));
                    prop_assert!(r.ready.iter().all(|s| r.receiving().any(|x| x == *s)));
                    prop_assert!(r.opened.keys().all(|s| r.receiving().any(|x| x == *s)));
                    if r.state == ResizeState::Done {
                        prop_assert!(r.receiving().all(|s| r.opened.contains_key(&s)));
                    }
                    if !r.opened.is_empty() {
                        prop_assert!(matches!(r.state, ResizeState::CutOver | ResizeState::Done));
                    }
                    if r.state == ResizeState::Cancelled {
                        prop_assert_eq!(next.num_shards, r.from);
                        prop_assert!(r.opening.is_empty() && r.opened.is_empty(), "a claimed resize cancelled");
                    }
                }
                map = next;
            }
        }
    }
}
