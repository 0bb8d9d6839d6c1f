//! Shared set-up of Tessera's tests, so that no test file keeps its own
//! copy: free ports, keys of a shard and f32 rows, a ps-server in-process
//! or as a process (started, SIGKILLed, restarted), waiting for a server's
//! health, a local etcd, a fault-injecting TCP proxy, a throw-away PKI
//! for TLS, the RPC layer's record of calls that gave up, and waiting for
//! a condition under a deadline (`wait`), and the kernel's view of a TCP
//! connection's queues (`sockets`), to wait on instead of sleeping.
//!
//! Everything here panics on failure: it is how a test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

pub mod cluster;
pub mod etcd;
pub mod give_ups;
pub mod health;
pub mod netns;
pub mod pair;
pub mod pki;
pub mod process;
pub mod proxy;
pub mod rdma;
pub mod resize;
pub mod rows;
pub mod server;
pub mod sockets;
pub mod wait;

pub use cluster::{InProcessCluster, Layout};
pub use etcd::Etcd;
pub use give_ups::GiveUps;
pub use health::{
    health, health_as, wait_for_health, wait_for_health_as, wait_replicas_in_step,
    wait_replicas_in_step_as, wait_serving, wait_serving_as,
};
pub use pair::{etcd_coordination, pair_config, pair_push};
pub use pki::TestPki;
pub use process::PsProcess;
pub use proxy::FaultProxy;
pub use resize::{
    keys_moved, resize_pair, resize_server, resize_servers, shard_map_now, split_push, wait_map,
};
pub use rows::{f32s, keys_of_shard, wire};
pub use server::InProcess;
use tessera_transport::sync::LockExt;

/// A free loopback port (released before the caller binds it: on
/// loopback the window for another process to take it is small), never
/// one this process was handed before: the kernel may give a port just
/// released to the next bind, and two servers of a test were once given
/// the same one (`peers lists this server itself`).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.locked();
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// `127.0.0.1:<free port>`.
pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}
