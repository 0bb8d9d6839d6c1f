//! The fault soak's schedule (issue 33): which faults a nemesis injects,
//! when, where and for how long, drawn from a seed so that a failing run
//! replays exactly (Jepsen's generators are the model: the schedule is
//! data, decided before the run, and printed with the run's report).
//!
//! Sans-IO: [`Schedule::draw`] takes the seed and the cluster's shape and
//! returns the faults in time order; the executor (the soak driver) applies
//! them, and decides at run time whether a destructive fault is safe (a
//! fault is deferred while the target's shard has no other copy in step:
//! the soak tests that acknowledged Pushes survive faults a replicated
//! cluster is built to survive, not a loss of every copy at once).
//!
//! The same seed gives the same schedule with the same build (the draws
//! come from `rand`'s `StdRng`, which a `rand` upgrade may change: the
//! report names the seed *and* prints the schedule).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a server; start it again after the hold.
    KillServer,
    /// SIGSTOP a server for the hold, then SIGCONT (a GC-like pause).
    PauseServer,
    /// SIGTERM a server, wait until it exited, start it again (a routine
    /// rolling restart step); the hold is how long it stays down.
    RestartServer,
    /// SIGKILL the etcd member that leads; start it again after the hold.
    KillEtcdLeader,
    /// Take a server's host off the network for the hold.
    CutLink,
    /// Take a server's host off the network and back, several times within
    /// the hold.
    FlapLink,
    /// Fill a server's checkpoint disk for the hold.
    FillCheckpointDisk,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [FaultKind; 7] = [
        FaultKind::KillServer,
        FaultKind::PauseServer,
        FaultKind::RestartServer,
        FaultKind::KillEtcdLeader,
        FaultKind::CutLink,
        FaultKind::FlapLink,
        FaultKind::FillCheckpointDisk,
    ];

    /// Whether this kind on `target` and `other` on `other_target` hit the
    /// same thing ([`Fault::same_target`]).
    pub fn same_target(self, target: usize, other: FaultKind, other_target: usize) -> bool {
        match (self.targets_etcd(), other.targets_etcd()) {
            (true, true) => true,
            (false, false) => target == other_target,
            _ => false,
        }
    }

    /// Its name in reports and `TESSERA_SOAK_KINDS` (snake case).
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::KillServer => "kill_server",
            FaultKind::PauseServer => "pause_server",
            FaultKind::RestartServer => "restart_server",
            FaultKind::KillEtcdLeader => "kill_etcd_leader",
            FaultKind::CutLink => "cut_link",
            FaultKind::FlapLink => "flap_link",
            FaultKind::FillCheckpointDisk => "fill_checkpoint_disk",
        }
    }

    /// The kind of `name` ([`FaultKind::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether it may lose a server's copy of its shards (the executor
    /// keeps another copy in step before it applies one).
    pub fn destructive(self) -> bool {
        matches!(self, FaultKind::KillServer | FaultKind::RestartServer)
    }

    /// Whether its target is an etcd member rather than a server.
    pub fn targets_etcd(self) -> bool {
        self == FaultKind::KillEtcdLeader
    }

    /// Shortest and longest hold, in milliseconds. Pauses stay below and
    /// above a failover timeout of 3 s; a cut link and a killed server
    /// stay down long enough for a failover.
    fn hold_range_ms(self) -> (u64, u64) {
        match self {
            FaultKind::KillServer => (1_000, 8_000),
            FaultKind::PauseServer => (200, 5_000),
            FaultKind::RestartServer => (0, 2_000),
            FaultKind::KillEtcdLeader => (500, 5_000),
            FaultKind::CutLink => (500, 8_000),
            FaultKind::FlapLink => (2_000, 6_000),
            FaultKind::FillCheckpointDisk => (2_000, 10_000),
        }
    }
}

/// One fault of a schedule.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fault {
    /// When it starts, from the start of the run.
    #[serde(serialize_with = "millis")]
    pub at: Duration,
    /// What it is.
    pub kind: FaultKind,
    /// The server (index in the cluster's order) or etcd member it hits.
    pub target: usize,
    /// How long it lasts.
    #[serde(serialize_with = "millis")]
    pub hold: Duration,
}

fn millis<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Fault {
    /// Whether a fault of `kind` on `target` would hit what this one hits:
    /// the same server, or etcd (one etcd fault at a time: an etcd fault
    /// hits whichever member leads, and two at once would take a
    /// three-member cluster's majority).
    pub fn same_target(&self, kind: FaultKind, target: usize) -> bool {
        self.kind.same_target(self.target, kind, target)
    }

    /// When it ends.
    pub fn until(&self) -> Duration {
        self.at + self.hold
    }
}

/// What a schedule is drawn for.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleConfig {
    /// The run's length; no fault starts in its last `quiet_tail` (the
    /// audit needs a settled cluster).
    pub duration: Duration,
    /// Faults-free time at the end.
    pub quiet_tail: Duration,
    /// Mean time between the starts of two faults (exponential gaps, so
    /// some overlap).
    pub mean_gap: Duration,
    /// The kinds to draw from (uniformly).
    pub kinds: Vec<FaultKind>,
    /// Servers in the cluster.
    pub servers: usize,
    /// etcd members (0: no etcd faults are drawn).
    pub etcd_members: usize,
    /// The most faults in force at once; a fault that would exceed it
    /// starts when the earliest one ends.
    pub max_concurrent: usize,
}

/// A seeded schedule of faults (module docs).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Schedule {
    /// The seed it was drawn from.
    pub seed: u64,
    /// The faults, by start time.
    pub faults: Vec<Fault>,
}

impl Schedule {
    /// The schedule of `seed` for `config`.
    pub fn draw(seed: u64, config: &ScheduleConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let kinds: Vec<FaultKind> = config
            .kinds
            .iter()
            .copied()
            .filter(|k| !k.targets_etcd() || config.etcd_members > 0)
            .filter(|k| k.targets_etcd() || config.servers > 0)
            .collect();
        let last_start = config.duration.saturating_sub(config.quiet_tail);
        let mut faults: Vec<Fault> = Vec::new();
        if kinds.is_empty() || config.max_concurrent == 0 {
            return Self { seed, faults };
        }
        let mean_gap_ms = config.mean_gap.as_millis().max(1) as f64;
        let mut at = Duration::ZERO;
        loop {
            // An exponential gap: -ln(U) * mean.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            at += Duration::from_millis((-u.ln() * mean_gap_ms) as u64);
            let kind = kinds[rng.random_range(0..kinds.len())];
            let target = if kind.targets_etcd() {
                rng.random_range(0..config.etcd_members)
            } else {
                rng.random_range(0..config.servers)
            };
            let (low, high) = kind.hold_range_ms();
            let hold = Duration::from_millis(rng.random_range(low..=high));
            // Not more than max_concurrent at once (wait for the earliest
            // of those in force to end), and never two on one target.
            let mut start = at;
            loop {
                let mut ends: Vec<Duration> = faults
                    .iter()
                    .map(Fault::until)
                    .filter(|&until| until > start)
                    .collect();
                ends.sort();
                let crowded = (ends.len() >= config.max_concurrent)
                    .then(|| ends[ends.len() - config.max_concurrent]);
                let busy = faults
                    .iter()
                    .filter(|f| f.same_target(kind, target))
                    .map(Fault::until)
                    .filter(|&until| until > start)
                    .max();
                match crowded.into_iter().chain(busy).max() {
                    Some(later) => start = later,
                    None => break,
                }
            }
            if start > last_start {
                break;
            }
            at = at.max(start);
            faults.push(Fault {
                at: start,
                kind,
                target,
                hold,
            });
        }
        faults.sort_by_key(|f| f.at);
        Self { seed, faults }
    }

    /// Faults drawn per kind.
    pub fn counts(&self) -> std::collections::BTreeMap<FaultKind, usize> {
        let mut counts = std::collections::BTreeMap::new();
        for fault in &self.faults {
            *counts.entry(fault.kind).or_insert(0) += 1;
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ScheduleConfig {
        ScheduleConfig {
            duration: Duration::from_secs(600),
            quiet_tail: Duration::from_secs(20),
            mean_gap: Duration::from_secs(5),
            kinds: FaultKind::ALL.to_vec(),
            servers: 4,
            etcd_members: 3,
            max_concurrent: 2,
        }
    }

    #[test]
    fn the_same_seed_replays_the_same_schedule_and_another_differs() {
        let a = Schedule::draw(7, &config());
        assert_eq!(a, Schedule::draw(7, &config()));
        assert_ne!(a.faults, Schedule::draw(8, &config()).faults);
        assert!(a.faults.len() > 50, "{} faults", a.faults.len());
        // Every kind comes up in ten minutes.
        assert_eq!(a.counts().len(), FaultKind::ALL.len(), "{:?}", a.counts());
    }

    #[test]
    fn limits_hold_for_many_seeds() {
        let config = config();
        for seed in 0..200 {
            let schedule = Schedule::draw(seed, &config);
            let faults = &schedule.faults;
            assert!(
                faults.windows(2).all(|w| w[0].at <= w[1].at),
                "seed {seed}: sorted"
            );
            for (i, f) in faults.iter().enumerate() {
                assert!(
                    f.at <= config.duration - config.quiet_tail,
                    "seed {seed}: {f:?} in the quiet tail"
                );
                let (low, high) = f.kind.hold_range_ms();
                assert!((low..=high).contains(&(f.hold.as_millis() as u64)));
                let limit = if f.kind.targets_etcd() {
                    config.etcd_members
                } else {
                    config.servers
                };
                assert!(f.target < limit, "seed {seed}: {f:?}");
                // At its start, at most max_concurrent in force (itself
                // included), and none other on its target.
                let in_force: Vec<&Fault> = faults[..=i]
                    .iter()
                    .filter(|g| g.at <= f.at && g.until() > f.at)
                    .collect();
                assert!(
                    in_force.len() <= config.max_concurrent,
                    "seed {seed}: {in_force:?}"
                );
                assert!(
                    !faults[..i]
                        .iter()
                        .any(|g| g.same_target(f.kind, f.target) && g.until() > f.at),
                    "seed {seed}: two faults on one target at once at {f:?}"
                );
            }
        }
    }

    #[test]
    fn names_round_trip_and_match_the_serialized_form() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::from_name(kind.name()), Some(kind));
            assert_eq!(
                serde_json::to_string(&kind).unwrap(),
                format!("\"{}\"", kind.name())
            );
        }
        assert_eq!(FaultKind::from_name("unplug_everything"), None);
    }

    #[test]
    fn one_etcd_fault_at_a_time_whatever_member_was_drawn() {
        let config = ScheduleConfig {
            kinds: vec![FaultKind::KillEtcdLeader],
            mean_gap: Duration::from_millis(500),
            ..config()
        };
        for seed in 0..50 {
            let faults = Schedule::draw(seed, &config).faults;
            assert!(
                faults.windows(2).all(|w| w[0].until() <= w[1].at),
                "seed {seed}: two etcd faults at once"
            );
        }
    }

    #[test]
    fn kinds_without_a_target_are_not_drawn() {
        let schedule = Schedule::draw(
            3,
            &ScheduleConfig {
                etcd_members: 0,
                ..config()
            },
        );
        assert!(!schedule.faults.iter().any(|f| f.kind.targets_etcd()));
        let none = Schedule::draw(
            3,
            &ScheduleConfig {
                kinds: vec![FaultKind::KillEtcdLeader],
                etcd_members: 0,
                ..config()
            },
        );
        assert!(none.faults.is_empty());
    }
}
