//! Replica selection: prefer the caller's failure domain, then
//! power-of-two-choices on an EWMA of latency weighted by outstanding
//! requests; fail over across domains when the own domain has no eligible
//! replica.
//!
//! Power of two choices (Mitzenmacher) keeps the load balanced without
//! herding onto the one best replica: two candidates are drawn at random
//! and the one with the lower score `ewma_latency × (outstanding + 1)`
//! wins. A replica with no samples yet scores with the mean of the others,
//! so a new or readmitted replica gets traffic at once; a readmitted one
//! starts without samples ([`ReplicaSelector::reset`]).
//!
//! A sample fades: its weight falls linearly to zero over
//! [`SAMPLE_FADE`] without a new one, towards the mean of the other
//! replicas. A replica that lost every pairing after one slow sample (a
//! timeout among microsecond answers) would otherwise never get the
//! samples that correct it; after the fade it ties with the others and is
//! tried again.
//!
//! A server fault (`Internal`, `Unknown`, `DataLoss`, `Unimplemented`,
//! `FailedPrecondition`) is fast but useless: it counts as a sample of at
//! least the penalty the caller gives (its attempt timeout), and does not
//! end a backoff ([`ReplicaSelector::fault`]), so a replica failing fast
//! does not attract traffic. An attempt whose caller gave up before it
//! ended ([`ReplicaSelector::abandon`]) only stops counting as
//! outstanding.
//!
//! A replica whose connection failed (refused, timed out, broke) is *down*
//! for a backoff that starts at 250 ms and doubles up to 10 s with each
//! failure in a row, like a gRPC subchannel in transient failure: callers
//! go to the others (even across domains) instead of paying a failed
//! attempt, and a retry token, per call; after the backoff one call tries
//! it again. The quarantine is the slower, statistical judgement on top.

use std::time::{Duration, Instant};

use rand::Rng;

/// A replica as the selector sees it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Its address (the quarantine's node name).
    pub addr: String,
    /// Its failure domain (zone, mini-pod).
    pub domain: String,
    ewma_us: Option<f64>,
    /// When the latest sample was taken.
    sampled_at: Option<Instant>,
    outstanding: u32,
    /// Connection backoff: down until then.
    down_until: Option<Instant>,
    /// The current backoff (zero while healthy).
    backoff: Duration,
}

impl Replica {
    /// A replica at `addr` in `domain`.
    pub fn new(addr: impl Into<String>, domain: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            domain: domain.into(),
            ewma_us: None,
            sampled_at: None,
            outstanding: 0,
            down_until: None,
            backoff: Duration::ZERO,
        }
    }
}

/// First connection backoff: long enough that a burst of calls does not
/// each pay a refused connection, short enough that a restarted replica is
/// back in use within a fraction of a second.
const INITIAL_BACKOFF: Duration = Duration::from_millis(250);
/// Longest connection backoff (a replica that stays down is tried every
/// 10 s by one call; the quarantine decides whether to exclude it).
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Weight of the newest sample in the latency average. 0.2: about the last
/// ten calls matter.
const EWMA_WEIGHT: f64 = 0.2;

/// How long a replica's latency average takes to fade to the others' mean
/// without new samples. 2 s: a few thousand calls on a busy shard, so a
/// replica that is slow keeps losing (it is re-measured by one call every
/// couple of seconds at most), while one slow moment is forgotten soon.
pub const SAMPLE_FADE: Duration = Duration::from_secs(2);

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

    /// Replica `i`'s latency average at `now`: faded towards `others`
    /// (the mean of the other replicas' averages) by its age; `None`
    /// without samples.
    fn latency_at(&self, i: usize, now: Instant, others: Option<f64>) -> Option<f64> {
        let r = &self.replicas[i];
        let ewma = r.ewma_us?;
        let (Some(at), Some(others)) = (r.sampled_at, others) else {
            return Some(ewma);
        };
        let age = now.saturating_duration_since(at).as_secs_f64();
        let weight = (1.0 - age / SAMPLE_FADE.as_secs_f64()).max(0.0);
        Some(others + (ewma - others) * weight)
    }

    /// The mean of the latency averages of every replica but `i`.
    fn others_mean(&self, i: usize) -> Option<f64> {
        let samples: Vec<f64> = self
            .replicas
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .filter_map(|(_, r)| r.ewma_us)
            .collect();
        (!samples.is_empty()).then(|| samples.iter().sum::<f64>() / samples.len() as f64)
    }

    fn score(&self, i: usize, now: Instant, mean: f64) -> f64 {
        let latency = self.latency_at(i, now, self.others_mean(i)).unwrap_or(mean);
        latency * f64::from(self.replicas[i].outstanding + 1)
    }

    /// Picks a replica for the next attempt at `now`: among those
    /// `eligible` says yes to (given each index and replica: not
    /// quarantined, not tried already), preferring the local domain.
    /// `None` if none is eligible.
    pub fn pick(
        &self,
        eligible: impl Fn(usize, &Replica) -> bool,
        now: Instant,
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
                Some(if self.score(b, now, mean) < self.score(a, now, mean) {
                    b
                } else {
                    a
                })
            }
        }
    }

    /// Picks the replica for a call's next attempt at `now`, given the
    /// replicas the call `tried` already (in order) and those the
    /// quarantine `excluded` (indexed like the replicas; missing entries
    /// count as excluded). In this order of preference:
    ///
    /// 1. not tried, not down, not quarantined;
    /// 2. not tried, not down (the quarantine never empties a set);
    /// 3. not tried (every replica left is backing off: try one rather than
    ///    fail without trying);
    /// 4. every replica was tried: one that is not down, preferring one
    ///    that did not fail last;
    /// 5. any but the one that failed last, then that one (a set of one
    ///    replica retries on it: a fresh connection if its connection
    ///    broke).
    ///
    /// Step 4 keeps a replica known to be unreachable from taking a call's
    /// attempts while a reachable one is there: with a primary killed and
    /// its replica slow once, the retry went back to the dead address,
    /// found it refused, and the call used up its attempts there.
    pub fn pick_for_attempt(
        &self,
        tried: &[usize],
        excluded: &[bool],
        now: Instant,
        rng: &mut impl Rng,
    ) -> Option<usize> {
        let untried = |i: usize| !tried.contains(&i);
        let up = |i: usize| !self.is_down(i, now);
        let not_last = |i: usize| tried.last() != Some(&i);
        self.pick(
            |i, _| untried(i) && up(i) && !excluded.get(i).copied().unwrap_or(true),
            now,
            rng,
        )
        .or_else(|| self.pick(|i, _| untried(i) && up(i), now, rng))
        .or_else(|| self.pick(|i, _| untried(i), now, rng))
        .or_else(|| self.pick(|i, _| up(i) && not_last(i), now, rng))
        .or_else(|| self.pick(|i, _| up(i), now, rng))
        .or_else(|| self.pick(|i, _| not_last(i), now, rng))
        .or_else(|| tried.last().copied())
    }

    /// An attempt on replica `i` starts.
    pub fn start(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding += 1;
        }
    }

    /// Whether replica `i` is in connection backoff at `now`.
    pub fn is_down(&self, i: usize, now: Instant) -> bool {
        self.replicas
            .get(i)
            .and_then(|r| r.down_until)
            .is_some_and(|until| now < until)
    }

    /// The attempt on replica `i` failed on its connection at `now`: ends
    /// the attempt (without a latency sample: a refused connection is fast
    /// and says nothing about serving speed) and backs the replica off —
    /// unless it is backing off already (the failure of a call that was
    /// under way when it went down).
    pub fn connection_failed(&mut self, i: usize, now: Instant) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding = r.outstanding.saturating_sub(1);
            if r.down_until.is_some_and(|until| now < until) {
                // Down already: calls that were in flight or queued when it
                // went down fail together; that is one failure, not a
                // doubling per call.
                return;
            }
            r.backoff = if r.backoff.is_zero() {
                INITIAL_BACKOFF
            } else {
                (r.backoff * 2).min(MAX_BACKOFF)
            };
            r.down_until = Some(now + r.backoff);
        }
    }

    /// The attempt on replica `i` ended at `now` after `latency`
    /// (failures other than connection failures and server faults count
    /// with the time they took: a slow failure makes a replica look slow).
    /// Any answer ends a backoff.
    pub fn finish(&mut self, i: usize, latency: Duration, now: Instant) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.down_until = None;
            r.backoff = Duration::ZERO;
        }
        self.sample(i, latency, now);
    }

    /// The attempt on replica `i` ended at `now` with a server fault after
    /// `latency`: a sample of at least `penalty`, and no end to a backoff.
    pub fn fault(&mut self, i: usize, latency: Duration, penalty: Duration, now: Instant) {
        self.sample(i, latency.max(penalty), now);
    }

    /// The caller gave up on the attempt on replica `i` before it ended
    /// (a sibling failed, the caller was cancelled): it no longer counts as
    /// outstanding, and says nothing of the replica.
    pub fn abandon(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding = r.outstanding.saturating_sub(1);
        }
    }

    /// Forgets what is known of replica `i`'s latency and backoff (it was
    /// readmitted from quarantine: what got it excluded is history).
    pub fn reset(&mut self, i: usize) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.ewma_us = None;
            r.sampled_at = None;
            r.down_until = None;
            r.backoff = Duration::ZERO;
        }
    }

    /// Attempts outstanding on each replica now.
    pub fn outstanding(&self) -> Vec<u32> {
        self.replicas.iter().map(|r| r.outstanding).collect()
    }

    fn sample(&mut self, i: usize, latency: Duration, now: Instant) {
        if let Some(r) = self.replicas.get_mut(i) {
            r.outstanding = r.outstanding.saturating_sub(1);
            let sample = latency.as_secs_f64() * 1e6;
            r.ewma_us = Some(match r.ewma_us {
                Some(old) => old + EWMA_WEIGHT * (sample - old),
                None => sample,
            });
            r.sampled_at = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    /// One fixed instant: no sample fades within a test unless it moves
    /// the clock on.
    fn t0() -> Instant {
        static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        *T0.get_or_init(Instant::now)
    }

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
            let i = selector.pick(|_, _| true, t0(), &mut rng).unwrap();
            assert_eq!(selector.replicas()[i].domain, "zone-a");
        }
        // Zone a down: zone b serves.
        for _ in 0..100 {
            let i = selector
                .pick(|_, r| r.domain != "zone-a", t0(), &mut rng)
                .unwrap();
            assert_eq!(selector.replicas()[i].domain, "zone-b");
        }
        assert_eq!(selector.pick(|_, _| false, t0(), &mut rng), None);
    }

    #[test]
    fn two_choices_favour_the_faster_and_less_loaded_replica() {
        let mut selector = set();
        let mut rng = StdRng::seed_from_u64(5);
        // a1 answers in 100 µs, a2 in 1 ms.
        for _ in 0..20 {
            selector.start(0);
            selector.finish(0, Duration::from_micros(100), t0());
            selector.start(1);
            selector.finish(1, Duration::from_millis(1), t0());
        }
        let picks: Vec<usize> = (0..1000)
            .map(|_| selector.pick(|_, _| true, t0(), &mut rng).unwrap())
            .collect();
        assert!(
            picks.iter().all(|&i| i == 0),
            "two local candidates: always the faster"
        );
        // Load counts too: 20 outstanding on a1 make a2 the better choice.
        for _ in 0..20 {
            selector.start(0);
        }
        assert_eq!(selector.pick(|_, _| true, t0(), &mut rng), Some(1));
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
            three.finish(i, Duration::from_micros(micros), t0());
        }
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            counts[three.pick(|_, _| true, t0(), &mut rng).unwrap()] += 1;
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
        selector.finish(0, Duration::from_micros(200), t0());
        let mut rng = StdRng::seed_from_u64(9);
        // Unknown latency scores as the mean (200 µs): ties go to the first
        // drawn, so both are picked.
        let mut seen = [false; 2];
        for _ in 0..100 {
            seen[selector.pick(|_, _| true, t0(), &mut rng).unwrap()] = true;
        }
        assert_eq!(seen, [true, true]);
    }

    #[test]
    fn a_failed_connection_backs_off_doubling_and_an_answer_ends_it() {
        let mut selector = set();
        let start = t0();
        selector.start(0);
        selector.connection_failed(0, start);
        assert!(selector.is_down(0, start));
        assert!(!selector.is_down(0, start + INITIAL_BACKOFF));
        let t1 = start + INITIAL_BACKOFF;
        selector.start(0);
        selector.connection_failed(0, t1);
        assert!(selector.is_down(0, t1 + INITIAL_BACKOFF));
        assert!(!selector.is_down(0, t1 + INITIAL_BACKOFF * 2));
        // Calls failing while it is down already are one failure (pattern
        // 3: twenty calls in flight must not double it twenty times).
        for _ in 0..20 {
            selector.connection_failed(0, t1);
        }
        assert!(!selector.is_down(0, t1 + INITIAL_BACKOFF * 2));
        // Each failure after a backoff ran out doubles it, up to the cap.
        let mut t = t1;
        for _ in 0..10 {
            t += MAX_BACKOFF;
            selector.connection_failed(0, t);
        }
        let t1 = t;
        assert!(selector.is_down(0, t1 + MAX_BACKOFF - Duration::from_millis(1)));
        assert!(!selector.is_down(0, t1 + MAX_BACKOFF));
        assert_eq!(selector.replicas()[0].outstanding, 0, "never below zero");
        selector.start(0);
        selector.finish(0, Duration::from_micros(50), start);
        assert!(!selector.is_down(0, t1));
        selector.connection_failed(0, t1);
        assert!(
            !selector.is_down(0, t1 + INITIAL_BACKOFF),
            "the backoff starts over after an answer"
        );
    }

    /// Pattern 4: one timeout sample (8 ms against 100 µs) made a replica
    /// lose every pairing for good; now it is tried again once the sample
    /// has faded, and a readmitted replica starts afresh.
    #[test]
    fn failure_pattern_one_slow_sample_does_not_starve_a_replica() {
        let mut selector =
            ReplicaSelector::new(vec![Replica::new("a", "z"), Replica::new("b", "z")], "z");
        let now = t0();
        selector.start(0);
        selector.finish(0, Duration::from_millis(8), now);
        for _ in 0..50 {
            selector.start(1);
            selector.finish(1, Duration::from_micros(100), now);
        }
        let mut rng = StdRng::seed_from_u64(21);
        let picks = |selector: &ReplicaSelector, at: Instant, rng: &mut StdRng| {
            (0..1000)
                .filter(|_| selector.pick(|_, _| true, at, rng) == Some(0))
                .count()
        };
        assert_eq!(picks(&selector, now, &mut rng), 0, "slow now: loses");
        let later = now + SAMPLE_FADE;
        assert!(
            picks(&selector, later, &mut rng) > 300,
            "after the fade it ties and is tried"
        );
        // Readmitted (reset): no stale average.
        selector.reset(0);
        assert!(picks(&selector, now, &mut rng) > 300);
    }

    /// Pattern 5: a replica answering `Internal` in 20 µs took most of the
    /// traffic; its faults now count as penalty samples.
    #[test]
    fn failure_pattern_fast_faults_do_not_attract_traffic() {
        let mut selector = ReplicaSelector::new(
            vec![Replica::new("good", "z"), Replica::new("bad", "z")],
            "z",
        );
        let now = t0();
        let mut rng = StdRng::seed_from_u64(4);
        for _ in 0..50 {
            selector.start(0);
            selector.finish(0, Duration::from_micros(300), now);
            selector.start(1);
            selector.fault(1, Duration::from_micros(20), Duration::from_millis(40), now);
        }
        let bad = (0..1000)
            .filter(|_| selector.pick(|_, _| true, now, &mut rng) == Some(1))
            .count();
        assert_eq!(bad, 0, "the faulting replica loses every pairing");
        // And a fault does not end a connection backoff.
        selector.start(1);
        selector.connection_failed(1, now);
        selector.start(1);
        selector.fault(1, Duration::from_micros(20), Duration::from_millis(40), now);
        assert!(selector.is_down(1, now));
    }

    /// Pattern 6: attempts whose callers gave up counted as outstanding
    /// for good and skewed every later choice.
    #[test]
    fn failure_pattern_abandoned_attempts_stop_counting() {
        let mut selector = set();
        for _ in 0..5 {
            selector.start(2);
        }
        for _ in 0..5 {
            selector.abandon(2);
        }
        selector.abandon(2);
        assert_eq!(selector.outstanding(), vec![0, 0, 0, 0]);
    }

    /// The drill `drill_rdma_ack_primary_failover_loses_at_most_the_unforwarded_tail`
    /// (2 of 7 suites): a Fetch's attempt on a killed primary failed, its
    /// retry on the replica failed too, and the third attempt went back to
    /// the dead primary ("any but the one that failed last"), was refused,
    /// and the Fetch gave up with its attempts used up while the replica
    /// served. A replica in connection backoff takes no retry while one
    /// that is not is there, even the one that failed last.
    #[test]
    fn failure_pattern_a_retry_does_not_go_back_to_a_dead_replica() {
        let mut selector =
            ReplicaSelector::new(vec![Replica::new("a", ""), Replica::new("b", "")], "");
        let mut rng = StdRng::seed_from_u64(11);
        // The primary's connection broke; the replica then timed out.
        selector.start(0);
        selector.connection_failed(0, t0());
        selector.start(1);
        selector.finish(1, Duration::from_secs(1), t0());
        let soon = t0() + Duration::from_millis(10);
        for tried in [[0, 1], [1, 0]] {
            for _ in 0..100 {
                assert_eq!(
                    selector.pick_for_attempt(&tried, &[false, false], soon, &mut rng),
                    Some(1),
                    "tried {tried:?}"
                );
            }
        }
        // Once its backoff ran out, the primary is worth a try again, as
        // the one that did not fail last.
        let later = t0() + Duration::from_secs(1);
        assert_eq!(
            selector.pick_for_attempt(&[0, 1], &[false, false], later, &mut rng),
            Some(0)
        );
    }

    #[test]
    fn an_attempt_prefers_untried_then_reachable_then_unquarantined_replicas() {
        let mut selector = ReplicaSelector::new(
            vec![
                Replica::new("a", ""),
                Replica::new("b", ""),
                Replica::new("c", ""),
            ],
            "",
        );
        let mut rng = StdRng::seed_from_u64(12);
        let now = t0();
        let mut pick = |selector: &ReplicaSelector, tried: &[usize], excluded: &[bool]| {
            selector.pick_for_attempt(tried, excluded, now, &mut rng)
        };
        // Not tried and not quarantined first.
        for _ in 0..50 {
            assert_eq!(pick(&selector, &[0], &[false, true, false]), Some(2));
        }
        // Every untried replica quarantined: one of them anyway.
        for _ in 0..50 {
            assert_eq!(pick(&selector, &[0, 2], &[false, true, true]), Some(1));
        }
        // An untried replica down: the untried one that is up.
        selector.start(1);
        selector.connection_failed(1, now);
        for _ in 0..50 {
            assert_eq!(pick(&selector, &[0], &[false; 3]), Some(2));
        }
        // Only a down replica untried: it, rather than a second try.
        assert_eq!(pick(&selector, &[0, 2], &[false; 3]), Some(1));
        // All tried: one that is up and did not fail last.
        for _ in 0..50 {
            assert_eq!(pick(&selector, &[1, 2, 0], &[false; 3]), Some(2));
        }
        // Every replica down: any but the last, then the last.
        selector.start(0);
        selector.connection_failed(0, now);
        selector.start(2);
        selector.connection_failed(2, now);
        for _ in 0..50 {
            assert_ne!(pick(&selector, &[0, 1, 2], &[false; 3]), Some(2));
        }
        let single = ReplicaSelector::new(vec![Replica::new("a", "")], "");
        assert_eq!(pick(&single, &[0], &[false]), Some(0));
        assert_eq!(pick(&single, &[], &[false]), Some(0));
    }
}
