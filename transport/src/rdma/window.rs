//! The per-engine send window (§6.3): a bound on the bytes of fragments
//! posted and not yet completed, separate from receive credits.
//!
//! Credits protect the *receiver's* receive queue; the window protects the
//! *network*: with many senders towards one receiver (incast), what each
//! may have in flight is bounded, so the switch buffers (and, on a lossless
//! fabric, PFC pauses) stay small.
//!
//! **Fixed mode** (`max_bytes`, `adaptive = false`): at most `max_bytes` in
//! flight, always.
//!
//! **Adaptive mode** (beyond the paper; a delay-based AIMD in the spirit of
//! TIMELY and Swift): the window `cwnd` moves between a floor (one fragment,
//! so that progress is always possible) and `max_bytes`, never above it.
//! Each completion reports the delay between posting a request and its
//! completion:
//! - delay ≤ `target_delay`: additive increase, `cwnd += fragment ×
//!   bytes_retired / cwnd` (about one fragment per window's worth of
//!   completions, i.e. per round trip);
//! - delay > `target_delay`: multiplicative decrease, `cwnd ×= 1 − β ×
//!   (delay − target) / delay` with β = 0.5, at most once per
//!   `target_delay` (so one burst of late completions counts once).

use std::time::{Duration, Instant};

/// Window settings (part of the RDMA config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    /// Bytes in flight allowed; 0 turns the window off.
    pub max_bytes: usize,
    /// Whether the window adapts to completion delay (below `max_bytes`).
    pub adaptive: bool,
    /// Completion delay above which the adaptive window shrinks.
    pub target_delay: Duration,
}

impl Default for WindowConfig {
    fn default() -> Self {
        Self {
            max_bytes: 0,
            adaptive: false,
            target_delay: Duration::from_micros(100),
        }
    }
}

/// The window of one engine.
#[derive(Debug, Clone)]
pub struct SendWindow {
    max: usize,
    floor: usize,
    cwnd: usize,
    fragment: usize,
    in_flight: usize,
    peak: usize,
    adaptive: Option<Duration>,
    last_decrease: Option<Instant>,
    stalls: u64,
}

const BETA: f64 = 0.5;

impl SendWindow {
    /// A window per `config` for an engine whose largest single request
    /// puts `fragment` bytes on the wire (the floor of an adaptive window).
    pub fn new(config: WindowConfig, fragment: usize) -> Self {
        let max = config.max_bytes;
        Self {
            max,
            floor: fragment.min(max),
            cwnd: max,
            fragment: fragment.max(1),
            in_flight: 0,
            peak: 0,
            adaptive: config.adaptive.then_some(config.target_delay),
            last_decrease: None,
            stalls: 0,
        }
    }

    /// Whether a bound applies.
    pub fn enabled(&self) -> bool {
        self.max > 0
    }

    /// The current bound (`usize::MAX` when off).
    pub fn limit(&self) -> usize {
        if self.enabled() {
            self.cwnd
        } else {
            usize::MAX
        }
    }

    /// Bytes in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Times a request waited for room.
    pub fn stalls(&self) -> u64 {
        self.stalls
    }

    /// Whether `bytes` more fit now; counts a stall if not.
    pub fn admit(&mut self, bytes: usize) -> bool {
        if !self.enabled() || self.in_flight + bytes <= self.cwnd {
            return true;
        }
        self.stalls += 1;
        false
    }

    /// `bytes` were posted.
    pub fn add(&mut self, bytes: usize) {
        self.in_flight += bytes;
        self.peak = self.peak.max(self.in_flight);
    }

    /// The most bytes ever in flight at once (tracked with the window off
    /// too: what the engine injected into the network at its peak).
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// `bytes` completed; `delay` is the completed request's post-to-
    /// completion time, if known.
    pub fn retire(&mut self, bytes: usize, delay: Option<Duration>, now: Instant) {
        self.in_flight = self.in_flight.saturating_sub(bytes);
        let (Some(target), Some(delay)) = (self.adaptive, delay) else {
            return;
        };
        if !self.enabled() {
            return;
        }
        if delay <= target {
            let step = (self.fragment as u128 * bytes as u128 / self.cwnd.max(1) as u128) as usize;
            self.cwnd = (self.cwnd + step.max(1)).min(self.max);
        } else if self
            .last_decrease
            .is_none_or(|last| now.saturating_duration_since(last) >= target)
        {
            let excess = (delay - target).as_secs_f64() / delay.as_secs_f64();
            let shrunk = self.cwnd as f64 * (1.0 - BETA * excess.min(1.0));
            self.cwnd = (shrunk as usize).clamp(self.floor, self.max);
            self.last_decrease = Some(now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_window_admits_up_to_its_bound_and_counts_stalls() {
        let mut window = SendWindow::new(
            WindowConfig {
                max_bytes: 8192,
                ..WindowConfig::default()
            },
            4096,
        );
        assert!(window.admit(4096));
        window.add(4096);
        assert!(window.admit(4096));
        window.add(4096);
        assert!(!window.admit(1));
        assert_eq!(window.stalls(), 1);
        window.retire(4096, None, Instant::now());
        assert!(window.admit(4096));
        let mut off = SendWindow::new(WindowConfig::default(), 4096);
        off.add(1 << 30);
        assert!(off.admit(1 << 30), "no bound when off");
    }

    #[test]
    fn an_adaptive_window_shrinks_on_delay_grows_when_fast_and_stays_in_bounds() {
        let target = Duration::from_micros(100);
        let mut window = SendWindow::new(
            WindowConfig {
                max_bytes: 64 << 10,
                adaptive: true,
                target_delay: target,
            },
            4096,
        );
        let start = Instant::now();
        let mut at = start;
        // Slow completions: shrinks, but never below one fragment.
        for _ in 0..200 {
            at += target * 2;
            window.add(4096);
            window.retire(4096, Some(Duration::from_millis(5)), at);
            assert!(window.limit() >= 4096 && window.limit() <= 64 << 10);
        }
        assert_eq!(window.limit(), 4096);
        // Fast completions: grows back, never above the maximum.
        for _ in 0..10_000 {
            at += target;
            window.add(4096);
            window.retire(4096, Some(Duration::from_micros(10)), at);
            assert!(window.limit() <= 64 << 10);
        }
        assert_eq!(window.limit(), 64 << 10);
        // A burst of late completions within one target interval counts once.
        let before = window.limit();
        for _ in 0..10 {
            window.retire(0, Some(Duration::from_millis(1)), at);
        }
        assert!(
            window.limit() >= before / 2,
            "{} after {before}",
            window.limit()
        );
    }
}
