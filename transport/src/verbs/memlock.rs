//! Locked memory: what registering pool memory with an RNIC costs.
//!
//! `ibv_reg_mr` pins the pages it registers: they are resident from then
//! on, and they count against the process's `RLIMIT_MEMLOCK` unless it has
//! `CAP_IPC_LOCK`. The limit is 8 MiB on many distributions and 64 KiB in
//! many containers, while the RDMA transport's first connection pins a few
//! pool blocks (4 MiB each by default), so without a raised limit the first
//! registration fails with a bare ENOMEM. The transport checks the limit
//! when it starts (`check`) and turns a failed registration into an
//! error that says what to raise ([`ADVICE`]). The soft provider pins
//! nothing (its memory is shared, not locked), so it is not held to this.

use crate::TransportConfig;
use crate::pool::RegistrationCause;

/// What an operator changes when locked memory runs out.
pub const ADVICE: &str = "raise the locked-memory limit: `ulimit -l unlimited` in the shell, \
     `LimitMEMLOCK=infinity` in a systemd unit; in a container, a memlock ulimit for the \
     runtime (docker `--ulimit memlock=-1`) or the IPC_LOCK capability";

/// The process's locked-memory limit in bytes (`None`: unlimited, or the
/// process has `CAP_IPC_LOCK`, which ignores it).
pub fn limit() -> Option<u64> {
    if has_ipc_lock() {
        return None;
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid out-parameter for getrlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return None;
    }
    (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Whether this process's effective capabilities include `CAP_IPC_LOCK`
/// (bit 14 of `CapEff` in `/proc/self/status`).
pub fn has_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Bytes the RDMA transport of `config` pins by its first connection: a
/// block of each pool for its first size classes (receive buffers and
/// control messages, the keepalive slot and small sends), and with shared
/// receive queues the buffers every I/O thread posts on its own; all of it
/// once per rail the configuration names (`devices = "all"` counts one:
/// the transport checks again with the rails it opened,
/// [`first_connection_bytes_on`]).
pub fn first_connection_bytes(config: &TransportConfig) -> u64 {
    first_connection_bytes_on(config, config.rdma.rail_count().unwrap_or(1) as u64)
}

/// [`first_connection_bytes`] with `rails` rails: every rail registers
/// every block (pinned once per rail), and every rail's I/O threads post
/// shared receives of their own, each registered on every rail.
pub fn first_connection_bytes_on(config: &TransportConfig, rails: u64) -> u64 {
    let rails = rails.max(1);
    let send = config.send_pool.block_size as u64;
    let recv = config.recv_pool.block_size as u64;
    let mut need = 2 * send + 2 * recv;
    if config.rdma.srq {
        let buffer = (config.rdma.small_message_limit + 64) as u64;
        let posted = config.rdma.io_threads as u64 * u64::from(config.rdma.srq_depth) * buffer;
        need += posted.div_ceil(recv) * recv * rails;
    }
    need.saturating_mul(rails)
}

/// The error for a transport that would pin `need` bytes under a limit of
/// `limit`, or `None` if it fits.
pub fn shortfall(limit: Option<u64>, need: u64) -> Option<LockedMemoryError> {
    match limit {
        Some(limit) if limit < need => Some(LockedMemoryError { limit, need }),
        _ => None,
    }
}

/// Locked memory too small for the RDMA transport.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the RDMA transport pins at least {need} bytes of registered memory by its first connection, \
     and the locked-memory limit (RLIMIT_MEMLOCK) is {limit} bytes: {ADVICE}; or lower \
     send_pool.block_size and recv_pool.block_size"
)]
pub struct LockedMemoryError {
    /// The limit.
    pub limit: u64,
    /// What the transport needs at least.
    pub need: u64,
}

/// Why a registration that failed with `errno` failed: for ENOMEM and
/// EPERM (what `ibv_reg_mr` answers when the limit is spent) the limit,
/// whose message says what to raise.
pub fn registration_failure(errno: i32) -> RegistrationCause {
    if errno == libc::ENOMEM || errno == libc::EPERM {
        RegistrationCause::LockedMemory {
            errno,
            limit: limit(),
        }
    } else {
        RegistrationCause::Kernel { errno }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_limit_says_what_is_needed_and_what_to_raise() {
        let config = TransportConfig::default();
        let need = first_connection_bytes(&config);
        assert_eq!(need, 16 << 20, "four 4 MiB blocks");
        let err = shortfall(Some(8 << 20), need).unwrap();
        let text = err.to_string();
        assert!(
            text.contains("16777216") && text.contains("8388608"),
            "{text}"
        );
        assert!(text.contains("LimitMEMLOCK"), "{text}");
        assert_eq!(shortfall(Some(64 << 20), need), None);
        assert_eq!(shortfall(None, need), None);
        let mut srq = TransportConfig::default();
        srq.rdma.srq = true;
        assert!(first_connection_bytes(&srq) > need);
        let short = registration_failure(libc::ENOMEM);
        assert!(
            matches!(short, RegistrationCause::LockedMemory { errno, .. } if errno == libc::ENOMEM),
            "{short:?}"
        );
        assert!(short.to_string().contains("ulimit -l"), "{short}");
        let other = registration_failure(libc::EINVAL);
        assert_eq!(
            other,
            RegistrationCause::Kernel {
                errno: libc::EINVAL
            }
        );
        assert!(!other.to_string().contains("ulimit"), "{other}");
    }

    #[test]
    fn every_rail_pins_the_blocks_and_its_own_shared_receives_on_every_rail() {
        let one = TransportConfig::default();
        let base = first_connection_bytes(&one);
        assert_eq!(first_connection_bytes_on(&one, 3), 3 * base);
        let mut two = one.clone();
        two.rdma.devices = Some(crate::Devices::Named(vec!["a".into(), "b".into()]));
        assert_eq!(first_connection_bytes(&two), 2 * base);
        let mut srq = TransportConfig::default();
        srq.rdma.srq = true;
        let posted = first_connection_bytes(&srq) - base;
        // Two rails: the blocks twice, and two rails' posted receives,
        // each registered on both.
        assert_eq!(first_connection_bytes_on(&srq, 2), 2 * base + 4 * posted);
    }
}
