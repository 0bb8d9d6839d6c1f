//! The election of one shard's primary, as one server takes part in it
//! (with an etcd coordinator), as a sans-IO state machine.
//!
//! The shard's primary key in etcd says who leads; it is put on the
//! leader's lease and disappears with it. The machine turns what the
//! server sees of that key into what it should do:
//!
//! - someone else holds the key: **follow** it;
//! - nobody does: **campaign** (the transaction that puts the key only if
//!   it is absent), at once if this server's copy was in step with the
//!   last primary, or it is the shard's preferred server (its replica
//!   group is `shard % replica_groups`) and has seen no primary yet (a
//!   fresh cluster), else after `failover_timeout`, so that the servers
//!   most likely to hold every Push try first. A preferred server that has
//!   seen a primary and is not in step (restarted, still copying) waits
//!   too: winning at once, its recovery could miss a primary whose lease
//!   had just lapsed and lead from its own stale copy;
//! - the campaign is won under an epoch: **recover** (copy the freshest
//!   copy among the live servers), then **lead**; a recovery that fails
//!   **resigns**, so another server can try;
//! - the key is gone, or the lease is: **stand down**.
//!
//! Call order: [`Election::handle_observed`] whenever the key is read or a
//! watch reports it; [`Election::handle_campaign`] with each campaign's
//! result; [`Election::handle_recovered`] with each recovery's;
//! [`Election::handle_lease_lost`] when the server's lease is gone. After
//! any of them, and whenever [`Election::poll_timeout`] passes, call
//! [`Election::poll_action`] until it returns `None`. Time is passed in.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tessera_coord::PrimaryRecord;

/// What the server should do for the shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Try to become the primary.
    Campaign,
    /// The campaign was won under `epoch`: recover the freshest copy, then
    /// report [`Election::handle_recovered`].
    Recover {
        /// The epoch won.
        epoch: u64,
    },
    /// Take Pushes under `epoch`.
    Lead {
        /// The epoch.
        epoch: u64,
    },
    /// Follow `primary`'s stream.
    Follow {
        /// Its address.
        primary: String,
        /// Its epoch.
        epoch: u64,
    },
    /// Neither lead nor follow: the shard has no primary now.
    StandDown,
    /// Give the primary key up (the recovery failed).
    Resign,
}

/// What the server is in the shard's election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Nothing observed yet.
    Unknown,
    /// Another server leads.
    Following {
        /// Its address.
        primary: String,
        /// Its epoch.
        epoch: u64,
    },
    /// No primary; campaigning at `at`.
    Vacant {
        /// When to campaign.
        at: Instant,
    },
    /// A campaign is on its way.
    Campaigning,
    /// Won `epoch`, recovering.
    Recovering {
        /// The epoch.
        epoch: u64,
    },
    /// The primary under `epoch`.
    Leading {
        /// The epoch.
        epoch: u64,
    },
}

/// One server's part in one shard's election (module docs).
#[derive(Debug)]
pub struct Election {
    me: String,
    preferred: bool,
    failover_timeout: Duration,
    phase: Phase,
    /// The highest epoch of any primary this server has seen (0: none).
    known_epoch: u64,
    /// The key as last observed while a campaign was on its way, and
    /// whether it was on this server's lease.
    seen_while_campaigning: Option<Option<(PrimaryRecord, bool)>>,
    actions: VecDeque<Action>,
}

/// How soon a failed campaign (etcd unreachable) is tried again.
const CAMPAIGN_RETRY: Duration = Duration::from_millis(200);

impl Election {
    /// The election of a shard by the server at `me`; `preferred` when
    /// its replica group is the shard's preferred one.
    pub fn new(me: String, preferred: bool, failover_timeout: Duration) -> Self {
        Self {
            me,
            preferred,
            failover_timeout,
            phase: Phase::Unknown,
            known_epoch: 0,
            seen_while_campaigning: None,
            actions: VecDeque::new(),
        }
    }

    /// Where the server stands.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// The key is `record` (`None`: absent), observed at `now`. `mine`:
    /// the key is on this server's current lease. `in_step`: this server's
    /// copy follows the primary's stream in order (it may take over
    /// without losing Pushes).
    pub fn handle_observed(
        &mut self,
        now: Instant,
        record: Option<&PrimaryRecord>,
        mine: bool,
        in_step: bool,
    ) {
        if let Some(record) = record {
            self.known_epoch = self.known_epoch.max(record.epoch);
        }
        if self.phase == Phase::Campaigning {
            self.seen_while_campaigning = Some(record.map(|r| (r.clone(), mine)));
            return;
        }
        match record {
            Some(record) if mine => match self.phase {
                Phase::Recovering { epoch } | Phase::Leading { epoch } if epoch == record.epoch => {
                }
                _ => {
                    // This lease's key from before (the driver restarted):
                    // recover under it.
                    self.phase = Phase::Recovering {
                        epoch: record.epoch,
                    };
                    self.actions.push_back(Action::Recover {
                        epoch: record.epoch,
                    });
                }
            },
            Some(record) if record.address == self.me => {
                // A previous process of this server, whose lease has not
                // expired yet: nothing to follow; wait for the key to go.
                if !matches!(self.phase, Phase::Following { .. }) {
                    self.actions.push_back(Action::StandDown);
                }
                self.phase = Phase::Following {
                    primary: record.address.clone(),
                    epoch: record.epoch,
                };
            }
            Some(record) => {
                let next = Phase::Following {
                    primary: record.address.clone(),
                    epoch: record.epoch,
                };
                if self.phase != next {
                    self.phase = next;
                    self.actions.push_back(Action::Follow {
                        primary: record.address.clone(),
                        epoch: record.epoch,
                    });
                }
            }
            None => {
                if matches!(
                    self.phase,
                    Phase::Leading { .. } | Phase::Recovering { .. } | Phase::Following { .. }
                ) {
                    self.actions.push_back(Action::StandDown);
                }
                let at = now
                    + if in_step || (self.preferred && self.known_epoch == 0) {
                        Duration::ZERO
                    } else {
                        self.failover_timeout
                    };
                self.phase = match self.phase {
                    Phase::Vacant { at: earlier } => Phase::Vacant {
                        at: earlier.min(at),
                    },
                    _ => Phase::Vacant { at },
                };
            }
        }
    }

    /// A campaign ended: `Ok(Some(epoch))` won, `Ok(None)` lost (the key
    /// exists, or another server issued an epoch first), `Err(())` failed
    /// (etcd unreachable).
    pub fn handle_campaign(&mut self, now: Instant, result: Result<Option<u64>, ()>) {
        if self.phase != Phase::Campaigning {
            return;
        }
        let seen = self.seen_while_campaigning.take();
        match result {
            Ok(Some(epoch)) => {
                self.phase = Phase::Recovering { epoch };
                self.actions.push_back(Action::Recover { epoch });
            }
            Ok(None) => {
                self.phase = Phase::Unknown;
                match seen {
                    Some(Some((record, mine))) => {
                        self.handle_observed(now, Some(&record), mine, false)
                    }
                    // Lost to a key the watch has not shown yet, or it went
                    // again: look again shortly.
                    _ => {
                        self.phase = Phase::Vacant {
                            at: now + CAMPAIGN_RETRY,
                        }
                    }
                }
            }
            Err(()) => {
                self.phase = Phase::Vacant {
                    at: now + CAMPAIGN_RETRY,
                };
            }
        }
    }

    /// The recovery under the won epoch ended (`ok`: this server holds the
    /// freshest copy).
    pub fn handle_recovered(&mut self, now: Instant, ok: bool) {
        let Phase::Recovering { epoch } = self.phase else {
            return;
        };
        if ok {
            self.phase = Phase::Leading { epoch };
            self.actions.push_back(Action::Lead { epoch });
        } else {
            self.actions.push_back(Action::StandDown);
            self.actions.push_back(Action::Resign);
            // Let another server try first.
            self.phase = Phase::Vacant {
                at: now + self.failover_timeout,
            };
        }
    }

    /// The server's lease is gone: it leads nothing any more.
    pub fn handle_lease_lost(&mut self) {
        if matches!(
            self.phase,
            Phase::Leading { .. } | Phase::Recovering { .. } | Phase::Campaigning
        ) {
            self.actions.push_back(Action::StandDown);
        }
        if !matches!(self.phase, Phase::Following { .. }) {
            self.phase = Phase::Unknown;
        }
        self.seen_while_campaigning = None;
    }

    /// The next thing to do at `now`, if any.
    pub fn poll_action(&mut self, now: Instant) -> Option<Action> {
        if let Some(action) = self.actions.pop_front() {
            return Some(action);
        }
        if let Phase::Vacant { at } = self.phase
            && now >= at
        {
            self.phase = Phase::Campaigning;
            self.seen_while_campaigning = None;
            return Some(Action::Campaign);
        }
        None
    }

    /// When [`Election::poll_action`] may have something to do without a
    /// new event.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.phase {
            Phase::Vacant { at } => Some(at),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(3);

    fn record(address: &str, epoch: u64) -> PrimaryRecord {
        PrimaryRecord {
            address: address.into(),
            epoch,
            replica_group: 0,
        }
    }

    fn drain(e: &mut Election, now: Instant) -> Vec<Action> {
        std::iter::from_fn(|| e.poll_action(now)).collect()
    }

    #[test]
    fn an_in_step_replica_campaigns_at_once_recovers_and_leads() {
        let t0 = Instant::now();
        let mut e = Election::new("b".into(), false, TIMEOUT);
        e.handle_observed(t0, Some(&record("a", 4)), false, false);
        assert_eq!(
            drain(&mut e, t0),
            [Action::Follow {
                primary: "a".into(),
                epoch: 4
            }]
        );
        // The same key seen again: nothing new.
        e.handle_observed(t0, Some(&record("a", 4)), false, true);
        assert!(drain(&mut e, t0).is_empty());
        // The primary's lease expired.
        e.handle_observed(t0, None, false, true);
        assert_eq!(drain(&mut e, t0), [Action::StandDown, Action::Campaign]);
        e.handle_campaign(t0, Ok(Some(7)));
        assert_eq!(drain(&mut e, t0), [Action::Recover { epoch: 7 }]);
        // Our own key shows up on the watch: still recovering.
        e.handle_observed(t0, Some(&record("b", 7)), true, true);
        assert!(drain(&mut e, t0).is_empty());
        e.handle_recovered(t0, true);
        assert_eq!(drain(&mut e, t0), [Action::Lead { epoch: 7 }]);
        assert_eq!(e.phase(), &Phase::Leading { epoch: 7 });
    }

    #[test]
    fn a_replica_out_of_step_waits_a_failover_timeout_before_campaigning() {
        let t0 = Instant::now();
        let mut e = Election::new("c".into(), false, TIMEOUT);
        e.handle_observed(t0, None, false, false);
        assert!(drain(&mut e, t0).is_empty());
        assert_eq!(e.poll_timeout(), Some(t0 + TIMEOUT));
        assert!(drain(&mut e, t0 + TIMEOUT - Duration::from_millis(1)).is_empty());
        // Someone else won meanwhile.
        e.handle_observed(
            t0 + Duration::from_secs(1),
            Some(&record("b", 8)),
            false,
            false,
        );
        assert_eq!(
            drain(&mut e, t0 + TIMEOUT),
            [Action::Follow {
                primary: "b".into(),
                epoch: 8
            }]
        );
        assert_eq!(e.poll_timeout(), None);
    }

    #[test]
    fn the_preferred_server_campaigns_at_once_on_a_fresh_cluster() {
        let t0 = Instant::now();
        let mut e = Election::new("a".into(), true, TIMEOUT);
        e.handle_observed(t0, None, false, false);
        assert_eq!(drain(&mut e, t0), [Action::Campaign]);
    }

    #[test]
    fn a_lost_campaign_follows_the_winner_and_a_failed_one_retries() {
        let t0 = Instant::now();
        let mut e = Election::new("b".into(), false, TIMEOUT);
        e.handle_observed(t0, None, false, true);
        assert_eq!(drain(&mut e, t0), [Action::Campaign]);
        // The watch shows the winner before the transaction answers.
        e.handle_observed(t0, Some(&record("c", 9)), false, true);
        e.handle_campaign(t0, Ok(None));
        assert_eq!(
            drain(&mut e, t0),
            [Action::Follow {
                primary: "c".into(),
                epoch: 9
            }]
        );
        // etcd unreachable: tried again shortly.
        let mut e = Election::new("b".into(), false, TIMEOUT);
        e.handle_observed(t0, None, false, true);
        assert_eq!(drain(&mut e, t0), [Action::Campaign]);
        e.handle_campaign(t0, Err(()));
        assert!(drain(&mut e, t0).is_empty());
        assert_eq!(drain(&mut e, t0 + CAMPAIGN_RETRY), [Action::Campaign]);
    }

    #[test]
    fn a_failed_recovery_resigns_and_a_lost_lease_stands_down() {
        let t0 = Instant::now();
        let mut e = Election::new("b".into(), true, TIMEOUT);
        e.handle_observed(t0, None, false, false);
        drain(&mut e, t0);
        e.handle_campaign(t0, Ok(Some(3)));
        drain(&mut e, t0);
        e.handle_recovered(t0, false);
        assert_eq!(drain(&mut e, t0), [Action::StandDown, Action::Resign]);
        assert_eq!(e.poll_timeout(), Some(t0 + TIMEOUT));
        // Won later, then the lease is lost: it stops leading at once.
        assert_eq!(drain(&mut e, t0 + TIMEOUT), [Action::Campaign]);
        e.handle_campaign(t0 + TIMEOUT, Ok(Some(5)));
        e.handle_recovered(t0 + TIMEOUT, true);
        assert_eq!(
            drain(&mut e, t0 + TIMEOUT),
            [Action::Recover { epoch: 5 }, Action::Lead { epoch: 5 }]
        );
        e.handle_lease_lost();
        assert_eq!(drain(&mut e, t0 + TIMEOUT), [Action::StandDown]);
        assert_eq!(e.phase(), &Phase::Unknown);
    }

    /// The transaction committed but its answer was lost: the key is on
    /// this server's lease. The next campaign finds it so (the etcd client
    /// reports it as won), and a watch event for it while campaigning is
    /// taken as this server's own.
    #[test]
    fn a_campaign_whose_answer_was_lost_still_leads() {
        let t0 = Instant::now();
        let mut e = Election::new("b".into(), false, TIMEOUT);
        e.handle_observed(t0, None, false, true);
        assert_eq!(drain(&mut e, t0), [Action::Campaign]);
        e.handle_observed(t0, Some(&record("b", 6)), true, true);
        e.handle_campaign(t0, Ok(None));
        assert_eq!(drain(&mut e, t0), [Action::Recover { epoch: 6 }]);
        assert_eq!(e.phase(), &Phase::Recovering { epoch: 6 });
    }

    #[test]
    fn a_key_of_a_previous_process_of_this_server_is_waited_out() {
        let t0 = Instant::now();
        let mut e = Election::new("a".into(), true, TIMEOUT);
        e.handle_observed(t0, Some(&record("a", 2)), false, false);
        assert_eq!(drain(&mut e, t0), [Action::StandDown]);
        // Not in step (a restarted process copies anew): it waits like
        // any server not in step.
        e.handle_observed(t0, None, false, false);
        assert_eq!(drain(&mut e, t0), [Action::StandDown]);
        assert_eq!(e.poll_timeout(), Some(t0 + TIMEOUT));
        assert_eq!(drain(&mut e, t0 + TIMEOUT), [Action::Campaign]);
    }

    /// A preferred server that followed another and is not in step (it
    /// restarted and is still copying the shard) does not campaign at
    /// once when the key goes: before, it did, and could win and lead
    /// from its stale copy while the primary whose lease had just lapsed
    /// was no longer registered for its recovery to ask.
    #[test]
    fn a_preferred_server_not_in_step_waits_after_having_followed() {
        let t0 = Instant::now();
        let mut e = Election::new("a".into(), true, TIMEOUT);
        e.handle_observed(t0, Some(&record("b", 2)), false, false);
        drain(&mut e, t0);
        e.handle_observed(t0, None, false, false);
        assert_eq!(drain(&mut e, t0), [Action::StandDown]);
        assert_eq!(e.poll_timeout(), Some(t0 + TIMEOUT));
        // In step, it would have gone at once.
        let mut in_step = Election::new("a".into(), true, TIMEOUT);
        in_step.handle_observed(t0, Some(&record("b", 2)), false, true);
        drain(&mut in_step, t0);
        in_step.handle_observed(t0, None, false, true);
        assert_eq!(
            drain(&mut in_step, t0),
            [Action::StandDown, Action::Campaign]
        );
    }

    #[test]
    fn leading_and_then_seeing_another_primary_follows_it() {
        let t0 = Instant::now();
        let mut e = Election::new("a".into(), true, TIMEOUT);
        e.handle_observed(t0, None, false, false);
        drain(&mut e, t0);
        e.handle_campaign(t0, Ok(Some(3)));
        e.handle_recovered(t0, true);
        drain(&mut e, t0);
        // Our key expired and another server took over before we noticed.
        e.handle_observed(t0, Some(&record("b", 4)), false, false);
        assert_eq!(
            drain(&mut e, t0),
            [Action::Follow {
                primary: "b".into(),
                epoch: 4
            }]
        );
    }
}
