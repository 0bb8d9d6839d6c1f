//! Replica selection: prefer the caller's failure domain, then
//! power-of-two-choices on an EWMA of latency weighted by outstanding
//! requests; fail over across domains when the own domain has no eligible
//! replica.
//!
//! Power of two choices (Mitzenmacher) keeps the load balanced without
//! herding onto the one best replica: two candidates are drawn at random
//! and the one with the lower score `ewma_latency × (outstanding + 1)`
//! wins. A replica with no samples yet scores with the mean of the others,
//! so a new or readmitted replica gets traffic at once.

use std::time::Duration;

use rand::Rng;

/// A replica as the selector sees it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Its address (the quarantine's node name).
    pub addr: String,
    /// Its failure domain (zone, mini-pod).
    pub domain: String,
    ewma_us: Option<f64>,
    outstanding: u32,
}

impl Replica {
    /// A replica at `addr` in `domain`.
    pub fn new(addr: impl Into<String>, domain: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            domain: domain.into(),
            ewma_us: None,
            outstanding: 0,
        }
    }
}

/// Weight of the newest sample in the latency average. 0.2: about the last
/// ten calls matter.
const EWMA_WEIGHT: f64 = 0.2;

/// Chooses among the replicas of one shard (see the module docs).
#[derive(Debug, Clone)]
pub struct ReplicaSelector {
    replicas: Vec<Replica>,
    local_domain: String,
}

impl ReplicaSelector {
    /// A selector for `replicas`, called from `local_domain`.
    pub fn new(replicas: Vec<Replica>, local_domain: impl Into<String>) -> Self {
        Self {
            replicas,
            local_domain: local_domain.into(),
        }
    }

    /// The replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    fn score(&self, i: usize, mean: f64) -> f64 {
        let r = &self.replicas[i];
        r.ewma_us.unwrap_or(mean) * f64::from(r.outstanding + 1)
    }

    /// Picks a replica for the next attempt: among those `eligible` says
    /// yes to (given each index and replica: not quarantined, not tried
    /// already), preferring the local domain. `None` if none is eligible.
    pub fn pick(
        &self,
        eligible: impl Fn(usize, &Replica) -> bool,
        rng: &mut impl Rng,
    ) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| eligible(i, &self.replicas[i]))
            .collect();
        let local: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| self.replicas[i].domain == self.local_domain)
            .collect();
        let pool = if local.is_empty() { candidates } else { local };
        match pool.len() {
            0 => None,
            1 => Some(pool[0]),
            n => {
                let samples: Vec<f64> = self.replicas.iter().filter_map(|r| r.ewma_us).collect();
                let mean = if samples.is_empty() {
                    1.0
                } else {
                    samples.iter().sum::<f64>() / samples.len() as f64
                };
                let a = pool[rng.random_range(0..n)];
                let mut b = pool[rng.random_range(0..n - 1)];
                if b == a {
                    b = pool[n - 1];
                }
                Some(if self.score(b, mean) < self.score(a, mean) {
                    b
                } else {
                    a
                })
            }
        }
    }

    /// An attempt on replica `i` starts.
    pub fn start(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding += 1;
        }
    }

    /// The attempt on replica `i` ended after `latency` (failures count
    /// with the time they took: a slow failure makes a replica look slow).
    pub fn finish(&mut self, i: usize, latency: Duration) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding = r.outstanding.saturating_sub(1);
            let sample = latency.as_secs_f64() * 1e6;
            r.ewma_us = Some(match r.ewma_us {
                Some(old) => old + EWMA_WEIGHT * (sample - old),
                None => sample,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn set() -> ReplicaSelector {
        ReplicaSelector::new(
            vec![
                Replica::new("a1", "zone-a"),
                Replica::new("a2", "zone-a"),
                Replica::new("b1", "zone-b"),
                Replica::new("b2", "zone-b"),
            ],
            "zone-a",
        )
    }

    #[test]
    fn the_local_domain_is_preferred_and_failover_crosses_domains() {
        let selector = set();
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..100 {
            let i = selector.pick(|_, _| true, &mut rng).unwrap();
            assert_eq!(selector.replicas()[i].domain, "zone-a");
        }
        // Zone a down: zone b serves.
        for _ in 0..100 {
            let i = selector
                .pick(|_, r| r.domain != "zone-a", &mut rng)
                .unwrap();
            assert_eq!(selector.replicas()[i].domain, "zone-b");
        }
        assert_eq!(selector.pick(|_, _| false, &mut rng), None);
    }

    #[test]
    fn two_choices_favour_the_faster_and_less_loaded_replica() {
        let mut selector = set();
        let mut rng = StdRng::seed_from_u64(5);
        // a1 answers in 100 µs, a2 in 1 ms.
        for _ in 0..20 {
            selector.start(0);
            selector.finish(0, Duration::from_micros(100));
            selector.start(1);
            selector.finish(1, Duration::from_millis(1));
        }
        let picks: Vec<usize> = (0..1000)
            .map(|_| selector.pick(|_, _| true, &mut rng).unwrap())
            .collect();
        assert!(
            picks.iter().all(|&i| i == 0),
            "two local candidates: always the faster"
        );
        // Load counts too: 20 outstanding on a1 make a2 the better choice.
        for _ in 0..20 {
            selector.start(0);
        }
        assert_eq!(selector.pick(|_, _| true, &mut rng), Some(1));
        // Across a domain of three, the slowest is never picked (it loses
        // every pairing) and the others share the traffic.
        let mut three = ReplicaSelector::new(
            vec![
                Replica::new("x", "z"),
                Replica::new("y", "z"),
                Replica::new("w", "z"),
            ],
            "z",
        );
        for (i, micros) in [(0, 100), (1, 120), (2, 5000)] {
            three.start(i);
            three.finish(i, Duration::from_micros(micros));
        }
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            counts[three.pick(|_, _| true, &mut rng).unwrap()] += 1;
        }
        assert_eq!(counts[2], 0, "{counts:?}");
        assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
    }

    #[test]
    fn a_replica_without_samples_still_gets_traffic() {
        let mut selector = ReplicaSelector::new(
            vec![Replica::new("old", "z"), Replica::new("new", "z")],
            "z",
        );
        selector.start(0);
        selector.finish(0, Duration::from_micros(200));
        let mut rng = StdRng::seed_from_u64(9);
        // Unknown latency scores as the mean (200 µs): ties go to the first
        // drawn, so both are picked.
        let mut seen = [false; 2];
        for _ in 0..100 {
            seen[selector.pick(|_, _| true, &mut rng).unwrap()] = true;
        }
        assert_eq!(seen, [true, true]);
    }
}
