//! Which verbs provider the suite's RDMA tests run over.
//!
//! By default the soft NIC, which every host has. With
//! `TESSERA_TEST_RDMA_PROVIDER=ibverbs` they run over the kernel's verbs
//! instead: `scripts/dev vm-test` sets it inside a Soft-RoCE VM, and
//! `scripts/dev hw-test` on a host with an RDMA device. A test about the soft
//! NIC itself (its fault dice, its port file, its link rate) keeps
//! [`TransportConfig::soft_rdma`] and says why in its doc; docs/src/development.md lists
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

/// The environment variable naming the ibverbs device the tests use
/// (`scripts/dev vm-test`: `rxe0`, the device whose netdev the port drill
/// takes down); unset: the first device.
pub const DEVICE_VAR: &str = "TESSERA_TEST_RDMA_DEVICE";

/// The RDMA settings' defaults over [`provider`] (over ibverbs on the
/// device [`DEVICE_VAR`] names, if it names one).
pub fn config_rdma() -> RdmaConfig {
    let device = match provider() {
        RdmaProvider::Soft => None,
        _ => std::env::var(DEVICE_VAR)
            .ok()
            .filter(|name| !name.is_empty()),
    };
    RdmaConfig {
        provider: provider(),
        device,
        ..TransportConfig::soft_rdma().rdma
    }
}

/// The environment variable naming the devices a rails test may open over
/// ibverbs, comma-separated (`scripts/dev vm-test`: `rxe0,rxe1`, two
/// Soft-RoCE devices on two dummy interfaces).
pub const RAILS_VAR: &str = "TESSERA_TEST_RDMA_RAILS";

/// [`config_rdma`] with `rails` rails: `rails` soft devices on the soft
/// NIC, or over ibverbs the first `rails` devices [`RAILS_VAR`] names.
/// `Err` says why there are not that many (the test then prints it as a
/// skip).
pub fn config_rails(rails: usize) -> Result<RdmaConfig, String> {
    let mut config = config_rdma();
    match provider() {
        RdmaProvider::Soft => {
            config.soft_rails = vec![tessera_transport::SoftRail::default(); rails];
        }
        _ => {
            let names: Vec<String> = std::env::var(RAILS_VAR)
                .unwrap_or_default()
                .split(',')
                .filter(|name| !name.is_empty())
                .map(str::to_owned)
                .collect();
            if names.len() < rails {
                return Err(format!(
                    "{RAILS_VAR} names {} ibverbs devices, the test needs {rails}",
                    names.len()
                ));
            }
            config.device = None;
            config.devices = Some(tessera_transport::Devices::Named(
                names.into_iter().take(rails).collect(),
            ));
        }
    }
    Ok(config)
}
