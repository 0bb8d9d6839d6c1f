//! Drills on a multi-host cluster of network namespaces
//! (`tessera_test_support::netns`): real ps-server processes on their own
//! hosts and addresses, a worker on another, and faults of the hosts and
//! of the links between them: issue 19's six drills and two link checks.
//!
//! - `fleet`: what they share (the fleet on the hosts, `tessera status`
//!   from a host, a ranker process, a trainer's client);
//! - `ranker`: drills 1 (a server SIGKILLed) and 2 (a link down,
//!   quarantine, readmission; 30 s with `TESSERA_DRILLS=full`);
//! - `rdma`: drill 3 (the RDMA path breaks, TCP works);
//! - `trainers`: drills 4 (a flapping link, exactly-once Pushes) and 5 (a
//!   primary's host cut off, failover with etcd);
//! - `incast`: drill 6 (16 trainers into one rate-limited server);
//! - `links`: a host's link down and up; a silent link's connection.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    missing_docs
)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_proto::v1::ShardRole;
use tessera_ps_server::config::{CoordinatorConfig, CoordinatorKind, PeerConfig};
use tessera_ps_server::{Mode, PsServerConfig, TableConfig};
use tessera_rpc::TransportKind;
use tessera_test_support::FaultProxy;
use tessera_test_support::netns::NetCluster;
use tessera_test_support::process::{PsProcess, ps_server_bin};
use tessera_worker::config::ServerEndpoint;
use tessera_worker::{PsClient, WorkerConfig};

#[path = "../common/mod.rs"]
mod common;
use common::KillOnDrop;

// The local drills use all of it; these drills a part.
#[allow(dead_code)]
#[path = "../drills/trainer.rs"]
mod trainer;
use trainer::{Trainer, audit, wait_identical, wait_role, wait_settled};

mod fleet;
mod incast;
mod links;
mod ranker;
mod rdma;
mod trainers;

use fleet::*;
