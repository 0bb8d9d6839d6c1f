//! A packet-level model of an RDMA fabric, for simulations that run
//! Tessera's real RDMA engine over hundreds of hosts in virtual time
//! (issue 58). It builds on [`tessera_sim`] (the clock, the seeded random
//! stream, the event queue) and, like the engine, is sans-IO: each part
//! takes events with the time passed in and says what follows, and the
//! simulation turns that into future events.
//!
//! # What is here
//!
//! - [`params`]: every parameter of the model, each defaulted to a
//!   published source (the HPCC ns-3 simulator's presets, the DCQCN
//!   paper) and validated, with errors that name the field.
//! - [`mmu`]: a switch's memory management unit: a shared buffer with
//!   per-ingress reserves and dynamic thresholds, PFC (XOFF/XON per
//!   ingress port, with headroom for the bytes in flight while a pause
//!   travels) and ECN marking at the egress queues (Kmin/Kmax/Pmax).
//! - [`port`]: an egress port: packets serialized at the link's rate,
//!   one after another, held while the peer pauses it.
//! - [`switch`]: a switch: egress ports over the MMU, PFC frames out,
//!   ECN marks on data packets.
//! - [`rnic`]: a host's NIC: RC queue pairs that packetize the work
//!   requests an engine posts, schedule them round robin (paced by DCQCN
//!   when on), acknowledge, go back N, answer receiver-not-ready, and
//!   place each message in registered memory when its last packet
//!   arrives (`tessera_transport::verbs::sim` checks keys and bounds as
//!   rxe does).
//! - [`net`]: NICs and switches wired as one ToR or a leaf-spine with
//!   ECMP, and the events that move packets and PFC frames between them.
//! - [`cluster`]: Tessera's real RDMA engines on the simulated hosts,
//!   driven through their `handle_*`/`poll_*` surface in virtual time.
//! - [`incast`]: the paper's incast (Table 4, Figure 15) on them.
//! - [`training`]: the paper's training fleet (Table 7) on them.
//! - [`calibration`]: `tessera-bench incast`'s real run over soft NICs
//!   at a set link rate, replayed here, so the two can be compared.
//! - [`tor`]: one top-of-rack switch with bare NICs sending raw flows
//!   (no engine): the fabric model alone, for its own checks.
//! - [`pause`]: the PFC pause log: every pause of every port, with its
//!   duration, and the first one (Table 4's measure).
//! - [`dcqcn`]: DCQCN's rate control at a sending NIC (the paper's
//!   "hardware congestion control").
//!
//! # Why a model of its own
//!
//! The fabric simulators with PFC, ECN and DCQCN are ns-3 based (the HPCC
//! simulator, its forks): C++, not embeddable in a Rust process that runs
//! thousands of real `Engine`s, and their clock is a global. The model
//! here follows the HPCC simulator's switch (its shared-buffer MMU is
//! the Broadcom-style one most RoCE studies use) so that its figures can
//! be compared with theirs; the code is written from its description,
//! not copied.
//!
//! # Known gaps
//!
//! One lossless traffic class (the paper's RDMA runs in one), so CNPs and
//! acknowledgements queue behind data (switches usually give CNPs a
//! priority of their own); no per-priority queues, no buffer carving per
//! egress port, no cut-through switching (a packet is forwarded once
//! whole). Hosts' CPUs take no time: an engine handles a completion the
//! moment its NIC produces it. Engines run unconfined (their peers write
//! with region keys; the NIC model supports memory windows, the cluster
//! does not bind them yet). PFC frames take a link delay and no wire
//! time.
//!
//! An incast on a simulated leaf-spine: a worker pulls from 16 servers
//! through Tessera's real RDMA engines, 4 Pulls without a send window;
//! the same seed gives the same run, byte for byte:
//!
//! ```
//! use tessera_fabric::incast::{IncastRun, run};
//!
//! let mut incast = IncastRun::new(16, 0, 1);
//! incast.pulls = 4;
//! let outcome = run(&incast)?;
//! assert_eq!(outcome.pull_latencies_ns.len(), 4);
//! assert_eq!(format!("{outcome:?}"), format!("{:?}", run(&incast)?));
//! # Ok::<(), tessera_fabric::cluster::ClusterError>(())
//! ```

pub mod calibration;
pub mod cluster;
pub mod dcqcn;
pub mod incast;
pub mod mmu;
pub mod net;
pub mod params;
pub mod pause;
pub mod port;
pub mod rnic;
pub mod switch;
pub mod tor;
pub mod training;

pub use dcqcn::{Dcqcn, DcqcnParams};
pub use mmu::{Admission, Mmu, Pfc};
pub use params::{EcnParams, LinkParams, ParamsError, SwitchParams};
pub use pause::PauseLog;
pub use port::{Port, Transmit};
