//! What a device can hold, and the check of a transport configuration
//! against it.
//!
//! Devices differ: rxe (Soft-RoCE) gives at most 32,767 entries per
//! completion queue where mlx5 gives millions, and a depth a device cannot
//! give makes `ibv_create_cq` or `ibv_create_qp` fail with a bare EINVAL.
//! So a provider reports its device's [`DeviceLimits`] (a real one from
//! `ibv_query_device`), enforces them at every create call, and the
//! transport checks its configuration against them when it starts
//! ([`fit`]): a queue depth above the device's is an error naming the
//! setting; the completion queue, which only has to be large enough, is
//! clamped to the device's largest (and said so in the log).

use tessera_config::ConfigError;

use super::{QpCaps, VerbsError};
use crate::config::RdmaConfig;

/// The limits of one device that Tessera's queues depend on (the fields of
/// `ibv_device_attr` of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Queue pairs.
    pub max_qp: u32,
    /// Work requests of one send or receive queue.
    pub max_qp_wr: u32,
    /// Scatter/gather entries of one work request.
    pub max_sge: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Entries of one completion queue.
    pub max_cqe: u32,
    /// Shared receive queues.
    pub max_srq: u32,
    /// Receives of one shared receive queue.
    pub max_srq_wr: u32,
    /// Bytes of one memory registration.
    pub max_mr_size: u64,
    /// Type-2 memory windows (`IBV_DEVICE_MEM_WINDOW_TYPE_2A`/`2B` in
    /// `device_cap_flags`, and `max_mw`): the device can confine a peer's
    /// writes to what it was granted (`rdma.confine_remote_writes`).
    pub memory_windows: u32,
}

impl DeviceLimits {
    /// What the soft NIC reports and enforces: rxe's limits (the kernel's
    /// `rxe_param.h` before 6.x raised some), the smallest of the devices
    /// Tessera meets, so that a configuration that starts on the soft NIC
    /// starts on real ones.
    pub const SOFT: Self = Self {
        max_qp: 0x1_0000,
        max_qp_wr: 0x4000,
        max_sge: 32,
        max_cq: 0x4000,
        max_cqe: 0x7fff,
        max_srq: 0x400,
        max_srq_wr: 0x4000,
        max_mr_size: u64::MAX,
        memory_windows: 0x1_0000,
    };

    /// A completion queue of `depth` entries fits.
    pub fn check_cq(&self, depth: u32) -> Result<(), VerbsError> {
        over("completion queue entries (max_cqe)", depth, self.max_cqe)
    }

    /// A queue pair with `caps` fits.
    pub fn check_qp(&self, caps: &QpCaps) -> Result<(), VerbsError> {
        over(
            "send queue depth (max_qp_wr)",
            caps.max_send_wr,
            self.max_qp_wr,
        )?;
        over(
            "receive queue depth (max_qp_wr)",
            caps.max_recv_wr,
            self.max_qp_wr,
        )?;
        over(
            "scatter/gather entries (max_sge)",
            caps.max_sge,
            self.max_sge,
        )
    }

    /// A shared receive queue of `depth` receives fits.
    pub fn check_srq(&self, depth: u32) -> Result<(), VerbsError> {
        over(
            "shared receive queue depth (max_srq_wr)",
            depth,
            self.max_srq_wr,
        )
    }
}

fn over(what: &'static str, asked: u32, max: u32) -> Result<(), VerbsError> {
    if asked > max {
        return Err(VerbsError::OverLimit { what, asked, max });
    }
    Ok(())
}

/// `config` as it will run on a device with `limits` (named `device` in
/// errors and logs): an error naming the first setting the device cannot
/// hold, or the configuration with `cq_depth` clamped to `max_cqe`.
pub fn fit(
    config: &RdmaConfig,
    limits: &DeviceLimits,
    device: &str,
) -> Result<RdmaConfig, ConfigError> {
    let refuse = |key: &str, value: u64, limit: &str, max: u64| {
        Err(ConfigError::Invalid {
            key: format!("rdma.{key}"),
            reason: format!("{value} is above device {device}'s {limit} of {max}"),
        })
    };
    let wr = u64::from(limits.max_qp_wr);
    if u64::from(config.send_queue_depth) > wr {
        return refuse(
            "send_queue_depth",
            config.send_queue_depth.into(),
            "max_qp_wr",
            wr,
        );
    }
    if u64::from(config.recv_queue_depth) > wr {
        return refuse(
            "recv_queue_depth",
            config.recv_queue_depth.into(),
            "max_qp_wr",
            wr,
        );
    }
    if config.srq && config.srq_depth > limits.max_srq_wr {
        return refuse(
            "srq_depth",
            config.srq_depth.into(),
            "max_srq_wr",
            limits.max_srq_wr.into(),
        );
    }
    if config.io_threads as u64 > u64::from(limits.max_cq) {
        return refuse(
            "io_threads",
            config.io_threads as u64,
            "max_cq (one completion queue per I/O thread)",
            limits.max_cq.into(),
        );
    }
    if config.confine_remote_writes && limits.memory_windows < config.windows_per_connection {
        return Err(ConfigError::Invalid {
            key: "rdma.confine_remote_writes".into(),
            reason: format!(
                "device {device} has {} type-2 memory windows, and confining a peer's writes to \
                 its grants needs {} per connection; set it to false to let peers write \
                 anywhere in the receive pool (or lower rdma.windows_per_connection)",
                limits.memory_windows, config.windows_per_connection
            ),
        });
    }
    let mut fitted = config.clone();
    if config.cq_depth > limits.max_cqe {
        tracing::info!(
            device,
            configured = config.cq_depth,
            max_cqe = limits.max_cqe,
            "rdma.cq_depth is above the device's largest completion queue: using its largest"
        );
        fitted.cq_depth = limits.max_cqe;
    }
    Ok(fitted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_beyond_the_device_name_their_setting_and_the_cq_is_clamped() {
        let limits = DeviceLimits::SOFT;
        // The defaults start on the smallest device (the CQ clamped).
        let fitted = fit(&RdmaConfig::default(), &limits, "soft").unwrap();
        assert_eq!(fitted.cq_depth, 32767);
        for (config, key) in [
            (
                RdmaConfig {
                    send_queue_depth: 0x4001,
                    ..RdmaConfig::default()
                },
                "rdma.send_queue_depth",
            ),
            (
                RdmaConfig {
                    recv_queue_depth: 0x8000,
                    ..RdmaConfig::default()
                },
                "rdma.recv_queue_depth",
            ),
            (
                RdmaConfig {
                    srq: true,
                    srq_depth: 0x4001,
                    ..RdmaConfig::default()
                },
                "rdma.srq_depth",
            ),
        ] {
            match fit(&config, &limits, "soft") {
                Err(ConfigError::Invalid { key: named, reason }) => {
                    assert_eq!(named, key);
                    assert!(reason.contains("device soft"), "{reason}");
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        // An unused SRQ depth is not held against the device.
        let unused = RdmaConfig {
            srq_depth: 0x4001,
            ..RdmaConfig::default()
        };
        assert!(fit(&unused, &limits, "soft").is_ok());
        // A device without type-2 memory windows cannot confine remote
        // writes: refused naming the key, unless confinement is off.
        let no_windows = DeviceLimits {
            memory_windows: 0,
            ..limits
        };
        match fit(&RdmaConfig::default(), &no_windows, "rxe0") {
            Err(ConfigError::Invalid { key, reason }) => {
                assert_eq!(key, "rdma.confine_remote_writes");
                assert!(reason.contains("rxe0"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        let open = RdmaConfig {
            confine_remote_writes: false,
            ..RdmaConfig::default()
        };
        assert!(fit(&open, &no_windows, "rxe0").is_ok());
    }

    #[test]
    fn create_calls_beyond_the_limits_are_refused() {
        let limits = DeviceLimits::SOFT;
        assert!(limits.check_cq(32767).is_ok());
        assert_eq!(
            limits.check_cq(32768),
            Err(VerbsError::OverLimit {
                what: "completion queue entries (max_cqe)",
                asked: 32768,
                max: 32767
            })
        );
        let caps = QpCaps {
            max_sge: 33,
            ..QpCaps::default()
        };
        assert!(matches!(
            limits.check_qp(&caps),
            Err(VerbsError::OverLimit { max: 32, .. })
        ));
        assert!(limits.check_srq(0x4001).is_err());
    }
}
