//! The transport rungs of the recovery ladder (§7.2): when the RDMA path to
//! one destination breaks, reconnect first (a fresh queue pair), and if that
//! fails too, send that destination's calls over TCP to the same address
//! (every RDMA listener also serves TCP), probing RDMA periodically and
//! moving back once a probe connects.
//!
//! The middle rung, another replica, is the [`crate::ReplicaSet`]'s: a call
//! whose attempt failed on the connection is retried elsewhere while this
//! ladder decides how the broken destination is reached next.
//!
//! One [`FallbackLadder`] per destination ([`crate::Channel`]); it is a
//! sans-IO state machine: the channel reports what happened
//! (`handle_*`), asks which path a new connection takes ([`path`]) and
//! whether to probe now ([`poll_probe`]), with the time passed in.
//!
//! [`path`]: FallbackLadder::path
//! [`poll_probe`]: FallbackLadder::poll_probe

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};

/// Settings of the RDMA-to-TCP fallback of a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FallbackConfig {
    /// Fall back to TCP at all. Default true: a broken RDMA path to a
    /// healthy server should cost a slower path, not failed calls.
    pub enabled: bool,
    /// RDMA connection attempts after a failure before falling back.
    /// Default 1: one fresh queue pair rules out a single QP's error state;
    /// a second failure in a row says the path itself is broken.
    pub reconnect_attempts: u32,
    /// How often a destination on TCP is probed over RDMA, in milliseconds.
    /// Default 5000: a probe is one handshake (cheap), and 5 s brings
    /// traffic back far sooner than the paper's operators did by hand while
    /// not hammering a path that is still broken.
    pub probe_interval_ms: u64,
}

impl Default for FallbackConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            reconnect_attempts: 1,
            probe_interval_ms: 5000,
        }
    }
}

impl FallbackConfig {
    /// The probe interval.
    pub fn probe_interval(&self) -> Duration {
        Duration::from_millis(self.probe_interval_ms)
    }
}

impl Validate for FallbackConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.probe_interval_ms == 0 {
            return Err(invalid("fallback.probe_interval_ms", "must be at least 1"));
        }
        Ok(())
    }
}

/// How long an RDMA connection must carry successful calls before its
/// destination's failure count is reset. 1 s: longer than a QP that
/// breaks under load survives, far shorter than a healthy one lives.
pub const HEALTHY_AFTER: Duration = Duration::from_secs(1);

/// Which transport a new connection to the destination uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The configured RDMA transport.
    Rdma,
    /// TCP to the same address.
    Tcp,
}

/// A step of the ladder, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LadderStep {
    /// The RDMA path failed; the next connection tries RDMA again.
    Reconnect,
    /// RDMA failed too often in a row; connections now use TCP.
    FallBack,
    /// An RDMA probe connected; connections use RDMA again.
    Return,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Rdma {
        /// RDMA failures since the last success.
        failures: u32,
    },
    Tcp {
        next_probe: Instant,
        probing: bool,
    },
}

/// The transport rungs of the ladder for one destination (module docs).
#[derive(Debug, Clone)]
pub struct FallbackLadder {
    config: FallbackConfig,
    state: State,
    /// A dial started by [`FallbackLadder::poll_return`] is under way.
    returning: bool,
    /// No return dial before then (the last one failed).
    return_after: Option<Instant>,
}

impl FallbackLadder {
    /// A ladder that starts on RDMA.
    pub fn new(config: FallbackConfig) -> Self {
        Self {
            config,
            state: State::Rdma { failures: 0 },
            returning: false,
            return_after: None,
        }
    }

    /// The path a new connection takes.
    pub fn path(&self) -> Path {
        match self.state {
            State::Rdma { .. } => Path::Rdma,
            State::Tcp { .. } => Path::Tcp,
        }
    }

    /// An RDMA connection attempt failed, or an RDMA connection broke
    /// (error, keepalive failure) at `now`.
    pub fn handle_rdma_failure(&mut self, now: Instant) -> Option<LadderStep> {
        match &mut self.state {
            State::Rdma { failures } => {
                *failures += 1;
                if self.config.enabled && *failures > self.config.reconnect_attempts {
                    self.state = State::Tcp {
                        next_probe: now + self.config.probe_interval(),
                        probing: false,
                    };
                    Some(LadderStep::FallBack)
                } else {
                    Some(LadderStep::Reconnect)
                }
            }
            // A probe's failure: wait for the next interval.
            State::Tcp { .. } => None,
        }
    }

    /// An RDMA connection has carried successful calls for a while
    /// ([`HEALTHY_AFTER`]): the path works, the failures before it are
    /// forgiven. A connection that handshakes and then dies under load
    /// does not get there, so it falls back like one that never connects
    /// (resetting on every successful handshake, it reconnected forever).
    pub fn handle_rdma_healthy(&mut self) {
        if let State::Rdma { failures } = &mut self.state {
            *failures = 0;
        }
    }

    /// Whether to start an RDMA probe now; at most one runs at a time.
    pub fn poll_probe(&mut self, now: Instant) -> bool {
        match &mut self.state {
            State::Tcp {
                next_probe,
                probing,
            } if !*probing && now >= *next_probe => {
                *probing = true;
                true
            }
            _ => false,
        }
    }

    /// Whether to dial RDMA now for a destination whose ladder says RDMA
    /// while its connection is TCP (a TCP link left over from before the
    /// return): at most one such dial at a time, like a probe.
    pub fn poll_return(&mut self, now: Instant) -> bool {
        match &mut self.state {
            State::Rdma { .. } if !self.returning && self.return_after.is_none_or(|t| now >= t) => {
                self.returning = true;
                true
            }
            _ => false,
        }
    }

    /// The outcome of the probe started after [`FallbackLadder::poll_probe`]
    /// or [`FallbackLadder::poll_return`].
    pub fn handle_probe(&mut self, connected: bool, now: Instant) -> Option<LadderStep> {
        self.returning = false;
        let State::Tcp { .. } = self.state else {
            // A return dial: a failed one waits an interval.
            self.return_after = (!connected).then(|| now + self.config.probe_interval());
            return None;
        };
        if connected {
            self.state = State::Rdma { failures: 0 };
            Some(LadderStep::Return)
        } else {
            self.state = State::Tcp {
                next_probe: now + self.config.probe_interval(),
                probing: false,
            };
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder() -> FallbackLadder {
        FallbackLadder::new(FallbackConfig {
            enabled: true,
            reconnect_attempts: 1,
            probe_interval_ms: 100,
        })
    }

    #[test]
    fn reconnects_once_then_falls_back_then_returns_after_a_probe() {
        let t0 = Instant::now();
        let mut ladder = ladder();
        assert_eq!(ladder.path(), Path::Rdma);
        assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::Reconnect));
        assert_eq!(ladder.path(), Path::Rdma, "first rung: a fresh QP");
        assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::FallBack));
        assert_eq!(ladder.path(), Path::Tcp);

        // No probe before the interval; exactly one at a time after it.
        assert!(!ladder.poll_probe(t0 + Duration::from_millis(99)));
        let t1 = t0 + Duration::from_millis(100);
        assert!(ladder.poll_probe(t1));
        assert!(!ladder.poll_probe(t1), "one probe at a time");
        // A failed probe waits a whole interval again.
        assert_eq!(ladder.handle_probe(false, t1), None);
        assert_eq!(ladder.path(), Path::Tcp);
        assert!(!ladder.poll_probe(t1 + Duration::from_millis(50)));
        let t2 = t1 + Duration::from_millis(100);
        assert!(ladder.poll_probe(t2));
        assert_eq!(ladder.handle_probe(true, t2), Some(LadderStep::Return));
        assert_eq!(ladder.path(), Path::Rdma);
        // Back on RDMA with a clean slate: one failure is a reconnect again.
        assert_eq!(ladder.handle_rdma_failure(t2), Some(LadderStep::Reconnect));
    }

    #[test]
    fn a_healthy_period_between_failures_resets_the_count() {
        let t0 = Instant::now();
        let mut ladder = ladder();
        for _ in 0..5 {
            assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::Reconnect));
            ladder.handle_rdma_healthy();
        }
        assert_eq!(ladder.path(), Path::Rdma);
    }

    /// Failure pattern 9: a QP that handshakes fine but dies under load
    /// reset the count at every reconnect and never fell back.
    #[test]
    fn failure_pattern_connections_that_die_young_fall_back() {
        let t0 = Instant::now();
        let mut ladder = ladder();
        // Connect (no reset), die, connect, die: the second death falls
        // back.
        assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::Reconnect));
        assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::FallBack));
        assert_eq!(ladder.path(), Path::Tcp);
    }

    #[test]
    fn disabled_fallback_keeps_reconnecting_over_rdma() {
        let t0 = Instant::now();
        let mut ladder = FallbackLadder::new(FallbackConfig {
            enabled: false,
            ..FallbackConfig::default()
        });
        for _ in 0..10 {
            assert_eq!(ladder.handle_rdma_failure(t0), Some(LadderStep::Reconnect));
        }
        assert_eq!(ladder.path(), Path::Rdma);
        assert!(!ladder.poll_probe(t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn late_failures_of_a_probe_do_not_move_the_ladder() {
        let t0 = Instant::now();
        let mut ladder = ladder();
        ladder.handle_rdma_failure(t0);
        ladder.handle_rdma_failure(t0);
        assert_eq!(ladder.handle_rdma_failure(t0), None);
        assert_eq!(ladder.path(), Path::Tcp);
        assert_eq!(ladder.handle_probe(true, t0), Some(LadderStep::Return));
        assert_eq!(ladder.handle_probe(true, t0), None, "already back");
    }

    #[test]
    fn zero_probe_interval_is_rejected_with_its_key() {
        let err = FallbackConfig {
            probe_interval_ms: 0,
            ..FallbackConfig::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.key(), Some("fallback.probe_interval_ms"), "{err}");
    }

    /// Failure pattern 8: the ladder says RDMA but the connection is TCP
    /// (a TCP dial raced with the probe that returned): a return dial is
    /// asked for, one at a time, and a failed one waits an interval.
    #[test]
    fn failure_pattern_rdma_ladder_on_a_tcp_link_dials_rdma_again() {
        let t0 = Instant::now();
        let mut ladder = ladder();
        assert!(ladder.poll_return(t0));
        assert!(!ladder.poll_return(t0), "one at a time");
        assert_eq!(ladder.handle_probe(false, t0), None);
        assert!(!ladder.poll_return(t0 + Duration::from_millis(99)));
        let t1 = t0 + Duration::from_millis(100);
        assert!(ladder.poll_return(t1));
        assert_eq!(ladder.handle_probe(true, t1), None);
        assert!(ladder.poll_return(t1), "asked again while they disagree");
        // On TCP, it is the probe's job.
        ladder.handle_probe(true, t1);
        ladder.handle_rdma_failure(t1);
        ladder.handle_rdma_failure(t1);
        assert!(!ladder.poll_return(t1 + Duration::from_secs(60)));
    }
}
