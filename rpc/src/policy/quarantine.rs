//! The quarantine list (§7.2): nodes that fail too often are excluded for
//! a while.
//!
//! Within a sliding `window`, more than `max_connect_failures` connection
//! failures or more than `max_request_failures` request failures to a node
//! eject it for a cooldown that doubles with every ejection in a row (from
//! `base_cooldown` up to `max_cooldown`) and resets once the node has been
//! readmitted and stayed clean for a window. After its cooldown a node is
//! readmitted with its failure counts cleared.
//!
//! An ejection cap keeps a replica set usable: at most
//! `max_ejected_fraction` of a set's nodes are excluded at once, and never
//! all of them. As Envoy learned the hard way (its `max_ejection_percent`
//! once compared before counting the candidate, letting one more through),
//! the cap is checked with the candidate counted.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Settings of a [`Quarantine`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuarantineConfig {
    /// The sliding window failures are counted in, seconds. Default 300
    /// (the paper's 5 minutes).
    pub window_secs: u64,
    /// Connection failures within the window beyond which a node is
    /// ejected. Default 30 (the paper's M).
    pub max_connect_failures: u32,
    /// Request failures within the window beyond which a node is ejected.
    /// Default 50 (the paper's N).
    pub max_request_failures: u32,
    /// First cooldown, seconds. Default 30.
    pub base_cooldown_secs: u64,
    /// Longest cooldown, seconds. Default 300.
    pub max_cooldown_secs: u64,
    /// Most of a replica set excluded at once. Default 0.5.
    pub max_ejected_fraction: f64,
}

impl Default for QuarantineConfig {
    fn default() -> Self {
        Self {
            window_secs: 300,
            max_connect_failures: 30,
            max_request_failures: 50,
            base_cooldown_secs: 30,
            max_cooldown_secs: 300,
            max_ejected_fraction: 0.5,
        }
    }
}

impl tessera_config::Validate for QuarantineConfig {
    fn validate(&self) -> Result<(), tessera_config::ConfigError> {
        use tessera_config::invalid;
        if self.window_secs == 0 {
            return Err(invalid("quarantine.window_secs", "must be at least 1"));
        }
        if self.base_cooldown_secs == 0 {
            return Err(invalid(
                "quarantine.base_cooldown_secs",
                "must be at least 1",
            ));
        }
        if self.max_cooldown_secs < self.base_cooldown_secs {
            return Err(invalid(
                "quarantine.max_cooldown_secs",
                "must be at least base_cooldown_secs",
            ));
        }
        if !(0.0..=1.0).contains(&self.max_ejected_fraction) {
            return Err(invalid(
                "quarantine.max_ejected_fraction",
                "must be between 0 and 1",
            ));
        }
        Ok(())
    }
}

/// An excluded node, as listed by [`Quarantine::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ejection {
    /// The node.
    pub node: String,
    /// Readmitted at.
    pub until: Instant,
    /// Ejections in a row.
    pub count: u32,
}

#[derive(Debug, Default)]
struct NodeState {
    connect_failures: VecDeque<Instant>,
    request_failures: VecDeque<Instant>,
    ejected_until: Option<Instant>,
    ejections: u32,
    readmitted_at: Option<Instant>,
}

/// The quarantine of one replica set (see the module docs).
#[derive(Debug)]
pub struct Quarantine {
    config: QuarantineConfig,
    nodes: HashMap<String, NodeState>,
    set_size: usize,
    readmissions: u64,
}

/// Which threshold a failure counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Connect,
    Request,
}

impl Quarantine {
    /// A quarantine for a set of `set_size` replicas.
    pub fn new(config: QuarantineConfig, set_size: usize) -> Self {
        Self {
            config,
            nodes: HashMap::new(),
            set_size,
            readmissions: 0,
        }
    }

    fn window(&self) -> Duration {
        Duration::from_secs(self.config.window_secs)
    }

    /// Ends cooldowns that are over.
    fn readmit(&mut self, now: Instant) {
        let window = self.window();
        for state in self.nodes.values_mut() {
            if state.ejected_until.is_some_and(|until| now >= until) {
                state.ejected_until = None;
                state.connect_failures.clear();
                state.request_failures.clear();
                state.readmitted_at = Some(now);
                self.readmissions += 1;
            }
            // Clean for a whole window after readmission: the streak ends.
            if state.ejected_until.is_none()
                && state
                    .readmitted_at
                    .is_some_and(|at| now.saturating_duration_since(at) >= window)
            {
                state.ejections = 0;
                state.readmitted_at = None;
            }
        }
    }

    /// Nodes readmitted after their cooldown so far (cleared ones not
    /// counted).
    pub fn readmissions(&self) -> u64 {
        self.readmissions
    }

    fn excluded_count(&self) -> usize {
        self.nodes
            .values()
            .filter(|s| s.ejected_until.is_some())
            .count()
    }

    /// A connection to `node` failed; returns the ejection if this one
    /// tipped it over.
    pub fn record_connect_failure(&mut self, node: &str, now: Instant) -> Option<Ejection> {
        self.record(node, Kind::Connect, now)
    }

    /// A request to `node` failed (timed out or lost).
    pub fn record_request_failure(&mut self, node: &str, now: Instant) -> Option<Ejection> {
        self.record(node, Kind::Request, now)
    }

    fn record(&mut self, node: &str, kind: Kind, now: Instant) -> Option<Ejection> {
        self.readmit(now);
        let window = self.window();
        let limit = match kind {
            Kind::Connect => self.config.max_connect_failures,
            Kind::Request => self.config.max_request_failures,
        } as usize;
        let state = self.nodes.entry(node.to_owned()).or_default();
        if state.ejected_until.is_some() {
            return None;
        }
        let failures = match kind {
            Kind::Connect => &mut state.connect_failures,
            Kind::Request => &mut state.request_failures,
        };
        failures.push_back(now);
        while failures
            .front()
            .is_some_and(|&at| now.saturating_duration_since(at) >= window)
        {
            failures.pop_front();
        }
        if failures.len() <= limit {
            return None;
        }
        // The cap, with this candidate counted.
        let after = self.excluded_count() + 1;
        let allowed = (self.config.max_ejected_fraction * self.set_size as f64).floor() as usize;
        if after > allowed || after >= self.set_size {
            return None;
        }
        let state = self.nodes.entry(node.to_owned()).or_default();
        state.ejections += 1;
        let factor = 2u32.saturating_pow(state.ejections - 1);
        let cooldown = Duration::from_secs(self.config.base_cooldown_secs)
            .saturating_mul(factor)
            .min(Duration::from_secs(self.config.max_cooldown_secs));
        let until = now + cooldown;
        state.ejected_until = Some(until);
        state.readmitted_at = None;
        Some(Ejection {
            node: node.to_owned(),
            until,
            count: state.ejections,
        })
    }

    /// Whether `node` is excluded now.
    pub fn is_excluded(&mut self, node: &str, now: Instant) -> bool {
        self.readmit(now);
        self.nodes
            .get(node)
            .is_some_and(|s| s.ejected_until.is_some())
    }

    /// The excluded nodes (for the admin call).
    pub fn list(&mut self, now: Instant) -> Vec<Ejection> {
        self.readmit(now);
        let mut out: Vec<Ejection> = self
            .nodes
            .iter()
            .filter_map(|(node, s)| {
                s.ejected_until.map(|until| Ejection {
                    node: node.clone(),
                    until,
                    count: s.ejections,
                })
            })
            .collect();
        out.sort_by(|a, b| a.node.cmp(&b.node));
        out
    }

    /// Readmits every node and forgets all failures (the admin call).
    pub fn clear(&mut self) {
        self.nodes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> QuarantineConfig {
        QuarantineConfig::default()
    }

    #[test]
    fn ejects_after_exactly_m_connect_or_n_request_failures() {
        let start = Instant::now();
        let mut q = Quarantine::new(config(), 4);
        for i in 0..30 {
            assert!(
                q.record_connect_failure("a", start + Duration::from_secs(i))
                    .is_none()
            );
        }
        assert!(!q.is_excluded("a", start + Duration::from_secs(30)));
        let ejected = q
            .record_connect_failure("a", start + Duration::from_secs(30))
            .unwrap();
        assert_eq!(ejected.count, 1);
        assert!(q.is_excluded("a", start + Duration::from_secs(31)));
        for _ in 0..50 {
            assert!(q.record_request_failure("b", start).is_none());
        }
        assert!(q.record_request_failure("b", start).is_some(), "the 51st");
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let start = Instant::now();
        let mut q = Quarantine::new(config(), 4);
        // 31 failures, but spread over more than the 5-minute window.
        for i in 0..31u64 {
            let at = start + Duration::from_secs(i * 11);
            assert!(q.record_connect_failure("a", at).is_none(), "failure {i}");
        }
    }

    #[test]
    fn cooldown_grows_with_repeated_ejections_and_the_node_comes_back() {
        let start = Instant::now();
        let mut q = Quarantine::new(config(), 4);
        let mut now = start;
        let mut cooldowns = Vec::new();
        for _ in 0..6 {
            let ejection = (0..31)
                .find_map(|_| q.record_connect_failure("a", now))
                .unwrap();
            cooldowns.push(ejection.until - now);
            assert!(q.is_excluded("a", ejection.until - Duration::from_millis(1)));
            now = ejection.until;
            assert!(!q.is_excluded("a", now), "readmitted after its cooldown");
        }
        let secs: Vec<u64> = cooldowns.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [30, 60, 120, 240, 300, 300]);
        // A clean window after readmission resets the streak.
        now += Duration::from_secs(301);
        assert!(!q.is_excluded("a", now));
        let again = (0..31)
            .find_map(|_| q.record_connect_failure("a", now))
            .unwrap();
        assert_eq!((again.count, (again.until - now).as_secs()), (1, 30));
    }

    #[test]
    fn the_cap_counts_the_candidate_and_never_excludes_everyone() {
        let now = Instant::now();
        let eject = |q: &mut Quarantine, node: &str| {
            (0..31).find_map(|_| q.record_connect_failure(node, now))
        };
        // Half of 4: two may go, the third may not.
        let mut q = Quarantine::new(config(), 4);
        assert!(eject(&mut q, "a").is_some());
        assert!(eject(&mut q, "b").is_some());
        assert!(eject(&mut q, "c").is_none(), "would exclude 3 of 4");
        assert!(!q.is_excluded("c", now));
        // Half of 3 rounds down to 1.
        let mut q = Quarantine::new(config(), 3);
        assert!(eject(&mut q, "a").is_some());
        assert!(eject(&mut q, "b").is_none());
        // Even a cap of 100% keeps one node.
        let mut q = Quarantine::new(
            QuarantineConfig {
                max_ejected_fraction: 1.0,
                ..config()
            },
            2,
        );
        assert!(eject(&mut q, "a").is_some());
        assert!(eject(&mut q, "b").is_none(), "never all of the set");
        // A set of one is never emptied.
        let mut q = Quarantine::new(config(), 1);
        assert!(eject(&mut q, "a").is_none());
    }

    #[test]
    fn the_list_can_be_read_and_cleared() {
        let now = Instant::now();
        let mut q = Quarantine::new(config(), 4);
        for _ in 0..31 {
            q.record_connect_failure("b", now);
        }
        let listed = q.list(now);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].node, "b");
        q.clear();
        assert!(q.list(now).is_empty());
        assert!(!q.is_excluded("b", now));
    }
}
