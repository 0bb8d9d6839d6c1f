//! Which verbs provider the suite's RDMA tests run over.
//!
//! By default the soft NIC, which every host has. With
//! `TESSERA_TEST_RDMA_PROVIDER=ibverbs` they run over the kernel's verbs
//! instead: `scripts/dev vm-test` sets it inside a Soft-RoCE VM, and
//! `scripts/dev hw-test` on a host with an RDMA device. A test about the soft
//! NIC itself (its fault dice, its port file, its link rate) keeps
//! [`TransportConfig::soft_rdma`] and says why in its doc; the README lists
//! both sets.
//!
//! An unknown value panics rather than falling back to the soft NIC: a run
//! that asked for ibverbs must never pass on the soft NIC without saying so.

use tessera_transport::{RdmaConfig, RdmaProvider, TransportConfig};

/// The environment variable naming the provider: `soft` (the default) or
/// `ibverbs`.
pub const PROVIDER_VAR: &str = "TESSERA_TEST_RDMA_PROVIDER";

/// The provider the RDMA tests run over (see the module doc).
pub fn provider() -> RdmaProvider {
    match std::env::var(PROVIDER_VAR) {
        Err(std::env::VarError::NotPresent) => RdmaProvider::Soft,
        Ok(value) if value.is_empty() || value == "soft" => RdmaProvider::Soft,
        Ok(value) if value == "ibverbs" => RdmaProvider::Ibverbs,
        Ok(other) => panic!("{PROVIDER_VAR}={other:?}: expected `soft` or `ibverbs`"),
        Err(err) => panic!("{PROVIDER_VAR}: {err}"),
    }
}

/// `soft` or `ibverbs`: for test names, labels and printed figures.
pub fn provider_name() -> &'static str {
    match provider() {
        RdmaProvider::Ibverbs => "ibverbs",
        _ => "soft",
    }
}

/// Whether the RDMA tests run over the kernel's verbs.
pub fn is_ibverbs() -> bool {
    provider() == RdmaProvider::Ibverbs
}

/// The transport's defaults with `kind = "rdma"` over [`provider`].
pub fn transport() -> TransportConfig {
    let mut config = TransportConfig::soft_rdma();
    config.rdma = config_rdma();
    config
}

/// The RDMA settings' defaults over [`provider`].
pub fn config_rdma() -> RdmaConfig {
    RdmaConfig {
        provider: provider(),
        ..TransportConfig::soft_rdma().rdma
    }
}
