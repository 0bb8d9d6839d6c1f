//! A registered region: one block of a size class, or one dedicated mapping.

use super::hook::{Access, RegisteredRegion};

/// Pool memory obtained from the OS and registered.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) base: usize,
    pub(crate) len: usize,
    /// Its registration on each rail, in rail order (never empty).
    pub(crate) keys: Vec<RegisteredRegion>,
    pub(crate) access: Access,
    pub(crate) pool_id: u64,
}

/// Facts about the registered region that contains an address: what a
/// transport needs to put the address in a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// First byte of the region.
    pub base: usize,
    /// Its length.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// The provider's handle of the registration (the `ibv_mr`), what a
    /// memory window is bound through.
    pub handle: u64,
    /// What peers may do to it.
    pub access: Access,
    /// The pool it belongs to.
    pub pool_id: u64,
}

impl Region {
    /// The region as `rail` registered it; `None` past the pool's rails.
    pub(crate) fn info_on(&self, rail: usize) -> Option<RegionInfo> {
        let keys = self.keys.get(rail)?;
        Some(RegionInfo {
            base: self.base,
            len: self.len,
            lkey: keys.lkey,
            rkey: keys.rkey,
            handle: keys.handle,
            access: self.access,
            pool_id: self.pool_id,
        })
    }
}
