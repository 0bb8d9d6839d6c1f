//! Settings of one registered-memory pool.

use serde::{Deserialize, Serialize};
use tessera_config::{ConfigError, Validate, invalid};

use super::page_map::GRANULE;

/// Settings of a [`super::Pool`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Name used in metrics labels and logs. Default `pool`.
    pub name: String,
    /// Bytes per block obtained from the OS and registered at once; a power
    /// of two of at least 1 MiB. Default 4 MiB (the paper's bemalloc): few
    /// enough registrations that a pool of gigabytes holds hundreds of
    /// memory regions, not millions, and small enough that one block per
    /// size class in use stays cheap.
    pub block_size: usize,
    /// Largest allocation served from size classes; larger ones get a
    /// dedicated registered mapping. At most `block_size / 2`. Default
    /// 1 MiB: a block then holds at least four objects of the largest class.
    pub max_class_size: usize,
    /// Ceiling on registered bytes; an allocation that would need more fails
    /// with an error. Default 16 GiB: far above this project's machines, so
    /// in practice the OS limits first unless a deployment sets it.
    pub max_registered_bytes: u64,
    /// Freed dedicated mappings kept (still registered) for reuse, in bytes.
    /// Default 256 MiB: a steady stream of large messages reuses mappings
    /// instead of registering a new one per message.
    pub dedicated_cache_bytes: u64,
    /// Bytes of each size class a thread keeps in its own cache before
    /// returning objects to the shared lists. Default 256 KiB: most
    /// allocations and frees touch no shared state, and an idle thread
    /// holds little.
    pub thread_cache_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            name: "pool".into(),
            block_size: 4 << 20,
            max_class_size: 1 << 20,
            max_registered_bytes: 16 << 30,
            dedicated_cache_bytes: 256 << 20,
            thread_cache_bytes: 256 << 10,
        }
    }
}

impl PoolConfig {
    /// The default configuration with `name`.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }
}

impl Validate for PoolConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !self.block_size.is_power_of_two() || self.block_size < GRANULE {
            return Err(invalid(
                "block_size",
                format!(
                    "{} is not a power of two of at least {GRANULE}",
                    self.block_size
                ),
            ));
        }
        if self.max_class_size < 16 || self.max_class_size > self.block_size / 2 {
            return Err(invalid(
                "max_class_size",
                format!(
                    "{} is outside 16..={}",
                    self.max_class_size,
                    self.block_size / 2
                ),
            ));
        }
        if self.max_registered_bytes < self.block_size as u64 {
            return Err(invalid(
                "max_registered_bytes",
                format!(
                    "{} is below one block ({})",
                    self.max_registered_bytes, self.block_size
                ),
            ));
        }
        Ok(())
    }
}
