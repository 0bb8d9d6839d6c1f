//! Registration of pool memory with the NIC.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// What a peer may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only the local NIC may read it (send buffers): a peer can never write
    /// into it.
    LocalOnly,
    /// Peers may WRITE into it (receive buffers offered to them), anywhere
    /// in a registered block, with the block's rkey.
    RemoteWrite,
    /// The local NIC writes into it (receives); peers may WRITE only
    /// through memory windows bound to parts of it
    /// ([`crate::verbs::SendOp::BindWindow`]): each grant confined to its
    /// own bytes and its own connection.
    Windows,
}

impl Access {
    /// Whether a peer may write into memory with this access using the
    /// region's own rkey.
    pub fn allows_remote_write(self) -> bool {
        matches!(self, Access::RemoteWrite)
    }
}

/// The keys a registration returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisteredRegion {
    /// Local key, used in local scatter/gather entries.
    pub lkey: u32,
    /// Remote key, given to peers that may access the region.
    pub rkey: u32,
    /// Provider-specific handle (for example a pointer to the `ibv_mr`).
    pub handle: u64,
}

/// A registration that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("memory registration of {len} bytes failed: {cause}")]
pub struct RegistrationError {
    /// Bytes that were to be registered.
    pub len: usize,
    /// Why the provider refused.
    #[source]
    pub cause: RegistrationCause,
}

/// Why a provider refused to register memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationCause {
    /// The soft NIC's table of regions is full.
    #[error("the soft NIC's region table is full ({regions} regions)")]
    RegionTableFull {
        /// Regions the table holds.
        regions: usize,
    },
    /// `ibv_reg_mr` ran out of lockable memory (`ENOMEM` or `EPERM`):
    /// registered memory is locked, and `limit` is the locked-memory limit
    /// (`None`: unlimited).
    #[error(
        "ibv_reg_mr: {}; registered memory is locked, and the locked-memory limit is {}: {}",
        std::io::Error::from_raw_os_error(*errno),
        limit.map_or("unlimited".to_owned(), |bytes| format!("{bytes} bytes")),
        crate::verbs::memlock::ADVICE
    )]
    LockedMemory {
        /// The `errno` of `ibv_reg_mr`.
        errno: i32,
        /// The process's locked-memory limit in bytes (`None`: unlimited).
        limit: Option<u64>,
    },
    /// The descriptor of shared pool memory could not be duplicated for a
    /// second rail's registration (`dup`: the open-file limit).
    #[error("duplicating the pool memory's descriptor for another rail: {}", std::io::Error::from_raw_os_error(*errno))]
    Descriptor {
        /// The `errno` of `dup`.
        errno: i32,
    },
    /// `ibv_reg_mr` failed for another reason.
    #[error("ibv_reg_mr: {}", std::io::Error::from_raw_os_error(*errno))]
    Kernel {
        /// The `errno` of `ibv_reg_mr`.
        errno: i32,
    },
}

/// Registers and deregisters memory with a NIC. Implemented by the verbs
/// providers; [`CountingHook`] serves TCP and tests.
///
/// A pool calls `register` when it obtains a block from the OS and
/// `deregister` before it returns the block; never on the allocation path
/// once the pool has grown to its working set.
pub trait RegistrationHook: Send + Sync + 'static {
    /// Registers `len` bytes at `addr` with `access`.
    fn register(
        &self,
        addr: usize,
        len: usize,
        access: Access,
    ) -> Result<RegisteredRegion, RegistrationError>;

    /// Deregisters a region returned by `register` for the same range.
    fn deregister(&self, addr: usize, len: usize, region: &RegisteredRegion);

    /// Whether this NIC needs pool memory it can share with other processes
    /// (the soft provider, whose peers in other processes write into it
    /// directly). The pool then backs its blocks with memfds and registers
    /// them through [`RegistrationHook::register_shared`].
    fn shares_memory(&self) -> bool {
        false
    }

    /// Registers `len` bytes at `addr`, a shared mapping of all of
    /// `memory`; the hook keeps the descriptor as long as it needs it.
    fn register_shared(
        &self,
        addr: usize,
        len: usize,
        access: Access,
        memory: std::os::fd::OwnedFd,
    ) -> Result<RegisteredRegion, RegistrationError> {
        drop(memory);
        self.register(addr, len, access)
    }
}

/// A hook that registers nothing but counts calls and hands out distinct
/// keys: what TCP needs (no NIC) and what tests use to see registrations.
#[derive(Debug, Default)]
pub struct CountingHook {
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    registered_bytes: AtomicU64,
    next_key: AtomicU32,
}

impl CountingHook {
    /// A hook with all counts at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls to `register` so far.
    pub fn registrations(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }

    /// Calls to `deregister` so far.
    pub fn deregistrations(&self) -> u64 {
        self.deregistrations.load(Ordering::Relaxed)
    }

    /// Bytes currently registered through this hook.
    pub fn registered_bytes(&self) -> u64 {
        self.registered_bytes.load(Ordering::Relaxed)
    }
}

impl RegistrationHook for CountingHook {
    fn register(
        &self,
        _addr: usize,
        len: usize,
        _access: Access,
    ) -> Result<RegisteredRegion, RegistrationError> {
        self.registrations.fetch_add(1, Ordering::Relaxed);
        self.registered_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        let key = self.next_key.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(RegisteredRegion {
            lkey: key,
            rkey: key,
            handle: u64::from(key),
        })
    }

    fn deregister(&self, _addr: usize, len: usize, _region: &RegisteredRegion) {
        self.deregistrations.fetch_add(1, Ordering::Relaxed);
        self.registered_bytes
            .fetch_sub(len as u64, Ordering::Relaxed);
    }
}
