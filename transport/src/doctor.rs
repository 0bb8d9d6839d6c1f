//! `tessera doctor`: what a host has for the transport, and what to change.
//!
//! The checks start what the configured transport would start rather than
//! guess at it: the verdict on the configured transport is whether
//! [`Transport::new`] succeeds with the configuration (device, port, GID,
//! queue limits and locked memory are all checked there), and the soft NIC
//! is tried with one message over a loopback connection. Around that, the
//! report lists the host's RDMA devices and ports (state, link layer, MTU,
//! GIDs with their types), the locked-memory limit against what the
//! transport pins, and fork safety; every problem comes with what to do.

use std::fmt;
use std::time::Duration;

use crate::verbs::memlock;
use crate::{Message, RdmaProvider, Transport, TransportConfig, TransportKind};

/// One thing that keeps (or may keep) the transport from running.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Problem {
    /// What is wrong.
    pub what: String,
    /// What to change.
    pub fix: String,
}

/// The locked-memory check.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Memlock {
    /// `RLIMIT_MEMLOCK` in bytes (`None`: unlimited or `CAP_IPC_LOCK`).
    pub limit: Option<u64>,
    /// Whether the process has `CAP_IPC_LOCK` (which ignores the limit).
    pub ipc_lock: bool,
    /// What the RDMA transport pins by its first connection.
    pub need: u64,
    /// Whether that fits.
    pub ok: bool,
}

/// One rail (device) of the configured transport, with what the host
/// says of its place: NUMA node and link rate (`None` where it says
/// nothing, as for the soft NIC and Soft-RoCE: such rails are equal).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RailReport {
    /// The device's name.
    pub name: String,
    /// Its NUMA node.
    pub numa_node: Option<u32>,
    /// Its port's link rate in Gbit/s.
    pub link_gbps: Option<f64>,
}

/// Everything `tessera doctor` found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The configured transport (`tcp`, `rdma`, `auto`) and provider.
    pub configured: String,
    /// Whether the configured transport starts on this host.
    pub can_run: bool,
    /// What it would run on (`auto`: RDMA or TCP, and why).
    pub would_use: String,
    /// The rails the configured RDMA transport opened, the primary first
    /// (empty where it does not start or runs over TCP).
    pub rails: Vec<RailReport>,
    /// The host's RDMA devices (ibverbs).
    #[cfg(feature = "ibverbs")]
    pub devices: Vec<crate::verbs::ibverbs::DeviceReport>,
    /// Why no device could be listed, if none could.
    pub devices_error: Option<String>,
    /// Locked memory against what the transport pins.
    pub memlock: Memlock,
    /// Fork safety of registered memory.
    pub fork: String,
    /// Why the soft NIC does not work here (one message over loopback),
    /// if it does not.
    pub soft_nic_error: Option<String>,
    /// What to change, in order of importance.
    pub problems: Vec<Problem>,
}

/// Runs every check for `config`.
pub async fn diagnose(config: &TransportConfig) -> Report {
    let mut problems = Vec::new();
    let configured = match config.kind {
        TransportKind::Tcp => "tcp".to_owned(),
        kind => format!(
            "{} (provider {})",
            kind.as_str(),
            provider_label(config.rdma.provider)
        ),
    };
    #[cfg(feature = "ibverbs")]
    let (devices, devices_error) = match crate::verbs::ibverbs::describe_devices() {
        Ok(devices) => (devices, None),
        Err(err) => (Vec::new(), Some(err.to_string())),
    };
    #[cfg(not(feature = "ibverbs"))]
    let devices_error = Some("this build has no ibverbs provider".to_owned());
    // Devices and locked memory matter where a real NIC is to be used.
    let wants_nic =
        config.kind != TransportKind::Tcp && config.rdma.provider == RdmaProvider::Ibverbs;
    #[cfg(feature = "ibverbs")]
    if wants_nic {
        if devices.is_empty() {
            problems.push(Problem {
                what: devices_error
                    .clone()
                    .unwrap_or_else(|| "no RDMA device".to_owned()),
                fix: "install an RNIC with its driver (rdma-core), or Soft-RoCE (`rdma link add \
                      rxe0 type rxe netdev <interface>`); between the processes of one host, \
                      provider = \"soft\" works without one; elsewhere transport = \"tcp\""
                    .into(),
            });
        }
        for device in &devices {
            if let Some(err) = &device.error {
                problems.push(Problem {
                    what: format!("device {} cannot be queried: {err}", device.name),
                    fix: "check the driver and permissions on /dev/infiniband".into(),
                });
            }
            for port in &device.ports {
                if !port.active {
                    problems.push(Problem {
                        what: format!("port {} of {} is not active", port.port, device.name),
                        fix: "bring the link up (`ibv_devinfo`, the switch port, the cable)".into(),
                    });
                } else if port.link_layer == "Ethernet" && port.picked_gid.is_none() {
                    problems.push(Problem {
                        what: format!("port {} of {} has no usable GID", port.port, device.name),
                        fix: "give the interface an IP address (RoCE v2 GIDs come from it)".into(),
                    });
                }
            }
        }
    }
    let limit = memlock::limit();
    // Every rail registers the pools: pinned once per rail.
    let need = memlock::first_connection_bytes(config);
    let memlock = Memlock {
        limit,
        ipc_lock: memlock::has_ipc_lock(),
        need,
        ok: memlock::shortfall(limit, need).is_none(),
    };
    if wants_nic && !memlock.ok {
        problems.push(Problem {
            what: format!(
                "locked-memory limit {} bytes is below the {need} the RDMA transport pins",
                limit.unwrap_or(0)
            ),
            fix: memlock::ADVICE.into(),
        });
    }
    #[cfg(feature = "ibverbs")]
    let fork = crate::verbs::ibverbs::fork_status().to_owned();
    #[cfg(not(feature = "ibverbs"))]
    let fork = "no ibverbs provider".to_owned();
    let soft_nic_error = soft_loopback().await.err();
    if let Some(err) = &soft_nic_error {
        problems.push(Problem {
            what: format!("the soft NIC does not work here: {err}"),
            fix: "the soft provider needs memfd and abstract unix sockets (Linux)".into(),
        });
    }
    // The verdict: start what the configuration starts.
    let mut rails = Vec::new();
    let (can_run, would_use) = match config.kind {
        TransportKind::Tcp => (true, "TCP".to_owned()),
        TransportKind::Rdma | TransportKind::Auto => {
            let mut rdma = config.clone();
            rdma.kind = TransportKind::Rdma;
            match Transport::new(rdma) {
                Ok(transport) => {
                    let names = transport.rails();
                    #[cfg(feature = "ibverbs")]
                    let port_of = |name: &str| {
                        devices.iter().find(|d| d.name == name).map(|d| {
                            let port = d.ports.iter().find(|p| p.port == config.rdma.port);
                            (d.numa_node, port.and_then(|p| p.link_gbps))
                        })
                    };
                    #[cfg(not(feature = "ibverbs"))]
                    let port_of = |_: &str| None::<(Option<u32>, Option<f64>)>;
                    rails = names
                        .iter()
                        .map(|name| {
                            let (numa_node, link_gbps) = port_of(name).unwrap_or((None, None));
                            RailReport {
                                name: name.clone(),
                                numa_node,
                                link_gbps,
                            }
                        })
                        .collect();
                    (true, format!("RDMA on {}", names.join(", ")))
                }
                Err(err) => {
                    let why = err.to_string();
                    if config.kind == TransportKind::Rdma {
                        problems.insert(
                            0,
                            Problem {
                                what: format!("the configured RDMA transport cannot start: {why}"),
                                fix: "see the problems below, or use transport = \"auto\" \
                                      (falls back to TCP) or \"tcp\""
                                    .into(),
                            },
                        );
                        (false, format!("nothing: {why}"))
                    } else {
                        (true, format!("TCP (RDMA cannot start: {why})"))
                    }
                }
            }
        }
    };
    Report {
        configured,
        can_run,
        would_use,
        rails,
        #[cfg(feature = "ibverbs")]
        devices,
        devices_error,
        memlock,
        fork,
        soft_nic_error,
        problems,
    }
}

fn provider_label(provider: RdmaProvider) -> &'static str {
    match provider {
        RdmaProvider::Ibverbs => "ibverbs",
        RdmaProvider::Soft => "soft",
    }
}

/// One message through the soft NIC between two transports of this
/// process, over loopback.
async fn soft_loopback() -> Result<(), String> {
    let attempt = async {
        let server = Transport::new(TransportConfig::soft_rdma()).map_err(|e| e.to_string())?;
        let client = Transport::new(TransportConfig::soft_rdma()).map_err(|e| e.to_string())?;
        let listener = server
            .listen("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener
            .local_addr()
            .map_err(|e| e.to_string())?
            .to_string();
        let accept = tokio::spawn(async move { listener.accept().await });
        let conn = client.connect(&addr).await.map_err(|e| e.to_string())?;
        let mut server_side = accept
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let buf = client
            .send_pool()
            .alloc_copy(b"doctor")
            .map_err(|e| e.to_string())?;
        conn.sender
            .send(Message::from(buf.freeze()))
            .await
            .map_err(|e| e.to_string())?;
        match server_side.receiver.recv().await {
            Ok(Some(got)) if &got[..] == b"doctor" => Ok(()),
            other => Err(format!("the message did not arrive: {other:?}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .map_err(|_| "no answer within 10 s".to_owned())?
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes = |ok: bool| if ok { "ok" } else { "PROBLEM" };
        writeln!(f, "configured transport   {}", self.configured)?;
        writeln!(
            f,
            "verdict                {} — would run on {}",
            if self.can_run {
                "can run"
            } else {
                "CANNOT RUN"
            },
            self.would_use
        )?;
        if !self.rails.is_empty() {
            writeln!(
                f,
                "rails                  {} ({}; a connection goes to the least used)",
                self.rails.len(),
                if self
                    .rails
                    .iter()
                    .all(|r| r.numa_node.is_none() && r.link_gbps.is_none())
                {
                    "the host says nothing of their place: equal"
                } else {
                    "NUMA node, link rate"
                }
            )?;
            for rail in &self.rails {
                let numa = rail
                    .numa_node
                    .map_or_else(|| "-".to_owned(), |n| n.to_string());
                let rate = rail
                    .link_gbps
                    .map_or_else(|| "-".to_owned(), |g| format!("{g} Gbit/s"));
                writeln!(f, "  {:<20} NUMA {numa:<4} {rate}", rail.name)?;
            }
        }
        writeln!(f)?;
        writeln!(f, "RDMA devices")?;
        if let Some(err) = &self.devices_error {
            writeln!(f, "  none: {err}")?;
        }
        #[cfg(feature = "ibverbs")]
        for device in &self.devices {
            match &device.limits {
                Some(l) => writeln!(
                    f,
                    "  {}  max_cqe {}  max_qp_wr {}  max_sge {}  max_srq_wr {}  max_qp {}",
                    device.name, l.max_cqe, l.max_qp_wr, l.max_sge, l.max_srq_wr, l.max_qp
                )?,
                None => writeln!(
                    f,
                    "  {}  {}",
                    device.name,
                    device.error.as_deref().unwrap_or("")
                )?,
            }
            for port in &device.ports {
                writeln!(
                    f,
                    "    port {}  {}  {}  {}  MTU {}  LID {}  NUMA {}  GID picked: {}",
                    port.port,
                    if port.active { "ACTIVE" } else { "not active" },
                    port.link_layer,
                    port.link_gbps
                        .map_or_else(|| "rate ?".to_owned(), |g| format!("{g} Gbit/s")),
                    port.mtu,
                    port.lid,
                    device
                        .numa_node
                        .map_or_else(|| "-".to_owned(), |n| n.to_string()),
                    port.picked_gid
                        .map_or_else(|| "-".to_owned(), |i| i.to_string())
                )?;
                for (index, gid, kind) in &port.gids {
                    writeln!(f, "      gid {index:>3}  {gid:<40} {kind}")?;
                }
            }
        }
        writeln!(f)?;
        let limit = self
            .memlock
            .limit
            .map_or_else(|| "unlimited".to_owned(), |l| format!("{l} bytes"));
        writeln!(
            f,
            "locked memory          {}  limit {limit}{}, the RDMA transport pins {} bytes",
            yes(self.memlock.ok),
            if self.memlock.ipc_lock {
                " (CAP_IPC_LOCK)"
            } else {
                ""
            },
            self.memlock.need
        )?;
        writeln!(f, "fork safety            {}", self.fork)?;
        match &self.soft_nic_error {
            None => writeln!(f, "soft NIC               ok (a message over loopback)")?,
            Some(err) => writeln!(f, "soft NIC               PROBLEM: {err}")?,
        }
        if !self.problems.is_empty() {
            writeln!(f)?;
            writeln!(f, "problems")?;
            for (i, problem) in self.problems.iter().enumerate() {
                writeln!(f, "  {}. {}", i + 1, problem.what)?;
                writeln!(f, "     fix: {}", problem.fix)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this project's machines there is no RDMA device: the report
    /// says so with the reason, the soft NIC works, TCP and `auto` can
    /// run, and an ibverbs RDMA transport cannot, as the first problem.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_device_the_report_says_so_and_rdma_cannot_run() {
        let tcp = diagnose(&TransportConfig::default()).await;
        assert!(tcp.can_run, "{tcp}");
        assert!(tcp.soft_nic_error.is_none(), "{tcp}");
        let soft = diagnose(&TransportConfig::soft_rdma()).await;
        assert!(soft.can_run, "{soft}");
        assert!(soft.would_use.starts_with("RDMA on soft"), "{soft}");
        #[cfg(feature = "ibverbs")]
        {
            let devices = crate::verbs::ibverbs::describe_devices();
            if let Ok(devices) = devices
                && !devices.is_empty()
            {
                eprintln!("SKIPPED the no-device half: this host has RDMA devices");
                return;
            }
            let mut rdma = TransportConfig {
                kind: TransportKind::Rdma,
                ..TransportConfig::default()
            };
            let report = diagnose(&rdma).await;
            assert!(!report.can_run, "{report}");
            assert!(report.devices_error.is_some(), "{report}");
            assert!(report.problems[0].what.contains("cannot start"), "{report}");
            let text = report.to_string();
            assert!(
                text.contains("CANNOT RUN") && text.contains("no RDMA device"),
                "{text}"
            );
            rdma.kind = TransportKind::Auto;
            let auto = diagnose(&rdma).await;
            assert!(auto.can_run && auto.would_use.starts_with("TCP"), "{auto}");
        }
    }

    /// Soft rails are listed, primary first, as equal (the soft NIC says
    /// nothing of NUMA or rate), and the memory check counts a pinning
    /// per rail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_report_lists_the_rails() {
        let mut config = TransportConfig::soft_rdma();
        config.rdma.soft_rails = vec![crate::SoftRail::default(); 3];
        let report = diagnose(&config).await;
        assert!(report.can_run, "{report}");
        let names: Vec<&str> = report.rails.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names.len(), 3, "{report}");
        assert!(names[1] == format!("{}.1", names[0]), "{names:?}");
        assert!(
            report
                .rails
                .iter()
                .all(|r| r.numa_node.is_none() && r.link_gbps.is_none())
        );
        let text = report.to_string();
        assert!(
            text.contains("rails                  3 (the host says nothing"),
            "{text}"
        );
        let one = diagnose(&TransportConfig::soft_rdma()).await;
        assert_eq!(one.rails.len(), 1);
        assert_eq!(report.memlock.need, 3 * one.memlock.need);
    }
}
