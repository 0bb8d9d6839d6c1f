//! The port's hardware counters (`/sys/class/infiniband/DEV/ports/N/hw_counters/`),
//! read where the provider has them: the receiver-not-ready events that a
//! device counts in the kernel and no work completion reports (an RC
//! sender's NIC retries them silently until `rnr_retry` runs out).
//!
//! Counters are device-wide (every process on the port adds to them) and
//! run from the driver's load, so a device reports the growth since it was
//! opened.

use std::path::PathBuf;

/// Names of the responder's count of RNR NAKs it sent (a SEND or
/// WRITE_WITH_IMM that found no receive posted), by provider: rxe's
/// `send_rnr_err`; mlx5's `out_of_buffer` (packets dropped for want of a
/// receive). The first that exists is used.
const RNR_COUNTERS: [&str; 2] = ["send_rnr_err", "out_of_buffer"];

/// One port's counter file.
#[derive(Debug, Clone)]
pub(super) struct PortCounter {
    path: PathBuf,
    baseline: u64,
}

impl PortCounter {
    /// The receiver-not-ready counter of `device`'s `port`, from now on;
    /// `None` where the provider has none.
    pub(super) fn rnr(device: &str, port: u8) -> Option<Self> {
        let dir = PathBuf::from(format!(
            "/sys/class/infiniband/{device}/ports/{port}/hw_counters"
        ));
        RNR_COUNTERS.iter().find_map(|name| {
            let path = dir.join(name);
            let baseline = read(&path)?;
            Some(Self { path, baseline })
        })
    }

    /// Growth since the counter was opened (0 if it cannot be read now).
    pub(super) fn value(&self) -> u64 {
        read(&self.path).map_or(0, |now| now.saturating_sub(self.baseline))
    }
}

fn read(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_without_counters_has_none() {
        assert!(PortCounter::rnr("no-such-device", 1).is_none());
    }

    #[test]
    fn a_counter_reports_its_growth_since_it_was_opened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("send_rnr_err");
        std::fs::write(&path, "40\n").unwrap();
        let counter = PortCounter {
            baseline: read(&path).unwrap(),
            path: path.clone(),
        };
        std::fs::write(&path, "47\n").unwrap();
        assert_eq!(counter.value(), 7);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(counter.value(), 0);
    }
}
