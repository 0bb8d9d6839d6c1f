//! How long a training Push takes to become visible in a serving fleet
//! (`ps-server/src/delta`), measured end to end per sampled Push: a
//! probe pushes to a key nobody else uses (so its row exists nowhere
//! yet), then reads it at the serving fleet until it is there. A serving
//! server answers a row it does not hold with zeros, and a Push moves
//! every value of a fresh row off its initial one, so the first Fetch
//! with a non-zero value is the Push made visible.
//!
//! The delay counts from the Push's send, so it includes the Push's own
//! latency, and is quantized by the poll period.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::PsClient;

/// What and how often to probe.
#[derive(Debug, Clone)]
pub struct ProbeConfig {
    /// The table pushed to and read (both fleets have it).
    pub table: String,
    /// Its dimension.
    pub dim: usize,
    /// A probe starts this often.
    pub every: Duration,
    /// A probe reads the serving fleet this often.
    pub poll: Duration,
    /// A probe not seen after this long counts as unseen.
    pub give_up: Duration,
    /// The first probe's key; probe `i` uses `first_key + i`. Keys no
    /// workload touches (the default is far above any workload's).
    pub first_key: u64,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            table: "embeddings".into(),
            dim: 32,
            every: Duration::from_millis(200),
            poll: Duration::from_millis(10),
            give_up: Duration::from_secs(30),
            first_key: 1 << 62,
        }
    }
}

/// The delays measured.
#[derive(Debug, Clone, Default)]
pub struct DelayReport {
    /// One per probe seen, sorted.
    pub delays: Vec<Duration>,
    /// Each probe seen: when it was pushed (since the run started) and
    /// its delay, in push order.
    pub timeline: Vec<(Duration, Duration)>,
    /// Probes never seen within `give_up`.
    pub unseen: u64,
    /// Probes whose Push failed (not counted otherwise).
    pub push_errors: u64,
    /// Serving Fetches that failed while polling (a refusing or
    /// restarting serving server; the probe goes on).
    pub fetch_errors: u64,
}

impl DelayReport {
    /// The `p`-th percentile (0..=100) of the delays, nearest rank.
    pub fn percentile(&self, p: f64) -> Option<Duration> {
        if self.delays.is_empty() {
            return None;
        }
        let rank = ((p / 100.0) * self.delays.len() as f64).ceil() as usize;
        Some(self.delays[rank.clamp(1, self.delays.len()) - 1])
    }

    /// `p50 / p90 / p99 / max` in milliseconds, for a report line.
    pub fn summary(&self) -> String {
        let ms =
            |d: Option<Duration>| d.map_or("-".into(), |d| format!("{:.0}", d.as_secs_f64() * 1e3));
        format!(
            "{} probes: delay p50 {} ms, p90 {} ms, p99 {} ms, max {} ms; {} unseen, {} push errors",
            self.delays.len(),
            ms(self.percentile(50.0)),
            ms(self.percentile(90.0)),
            ms(self.percentile(99.0)),
            ms(self.delays.last().copied()),
            self.unseen,
            self.push_errors
        )
    }
}

/// One probe's end.
enum Outcome {
    Seen(Duration, Duration),
    Unseen,
    PushFailed,
}

/// Probes until `stop` completes (probes in flight then finish, up to
/// `give_up`): pushes through `training`, reads through `serving`.
pub async fn probe(
    training: Arc<PsClient>,
    serving: Arc<PsClient>,
    config: &ProbeConfig,
    stop: impl std::future::Future<Output = ()>,
) -> DelayReport {
    let started = Instant::now();
    let fetch_errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut probes = tokio::task::JoinSet::new();
    let mut ticks = tokio::time::interval(config.every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    let mut i = 0u64;
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = &mut stop => break,
        }
        let key = config.first_key + i;
        i += 1;
        let (training, serving, config) =
            (Arc::clone(&training), Arc::clone(&serving), config.clone());
        let fetch_errors = Arc::clone(&fetch_errors);
        probes.spawn(async move {
            let gradient = vec![-1.0f32; config.dim];
            let sent = Instant::now();
            if training
                .push(&config.table, &[key], &gradient, config.dim)
                .await
                .is_err()
            {
                return Outcome::PushFailed;
            }
            while sent.elapsed() < config.give_up {
                match serving.fetch(&config.table, &[key]).await {
                    Ok(rows) if rows.values().iter().any(|v| *v != 0.0) => {
                        return Outcome::Seen(sent - started, sent.elapsed());
                    }
                    Ok(_) => {}
                    Err(_) => {
                        fetch_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(config.poll).await;
            }
            Outcome::Unseen
        });
    }
    let mut report = DelayReport::default();
    while let Some(outcome) = probes.join_next().await {
        match outcome {
            Ok(Outcome::Seen(at, delay)) => {
                report.delays.push(delay);
                report.timeline.push((at, delay));
            }
            Ok(Outcome::Unseen) => report.unseen += 1,
            Ok(Outcome::PushFailed) | Err(_) => report.push_errors += 1,
        }
    }
    report.delays.sort_unstable();
    report.timeline.sort_unstable();
    report.fetch_errors = fetch_errors.load(std::sync::atomic::Ordering::Relaxed);
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let report = DelayReport {
            delays: (1..=100).map(Duration::from_millis).collect(),
            ..DelayReport::default()
        };
        assert_eq!(report.percentile(50.0), Some(Duration::from_millis(50)));
        assert_eq!(report.percentile(99.0), Some(Duration::from_millis(99)));
        assert_eq!(report.percentile(100.0), Some(Duration::from_millis(100)));
        assert_eq!(report.percentile(0.0), Some(Duration::from_millis(1)));
        assert_eq!(DelayReport::default().percentile(50.0), None);
    }
}
