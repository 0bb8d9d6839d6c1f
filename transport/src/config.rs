//! The transport's configuration: [`TransportConfig`] (which transport,
//! message limits, pools, inbound budget, TLS) and its `[rdma]` table
//! [`RdmaConfig`] (provider, devices and rails, queue depths, fragments,
//! the send window, keepalive, polling), each field with its default and
//! the reason for it. Loading validates every field and names the key of
//! the first one that is wrong (`tessera_config::Validate`); the engine's
//! own settings are derived from these by
//! `rdma::connection::engine_config`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
pub use tessera_config::ConfigError;
use tessera_config::{Validate, invalid};

use crate::inbound::InboundConfig;
use crate::pool::PoolConfig;
use crate::tls::TlsConfig;

/// Which transport carries the messages.
///
/// Parsed from the `transport` setting of every component. Values that are
/// not (yet) supported are rejected with an error naming the setting and the
/// allowed values rather than being silently mapped to something else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum TransportKind {
    /// Length-prefixed frames over TCP (tokio).
    #[default]
    Tcp,
    /// RC queue pairs through a verbs provider (see [`RdmaConfig`]).
    Rdma,
    /// RDMA where the configured provider has a device and the peer speaks
    /// it, else TCP; the log says which and why.
    Auto,
}

impl TransportKind {
    /// The values accepted for the `transport` setting.
    pub const ALLOWED: &'static [&'static str] = &["tcp", "rdma", "auto"];

    /// The canonical name of this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Rdma => "rdma",
            TransportKind::Auto => "auto",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TransportKind {
    type Err = ConfigError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "tcp" => Ok(TransportKind::Tcp),
            "rdma" => Ok(TransportKind::Rdma),
            "auto" => Ok(TransportKind::Auto),
            other => Err(invalid(
                "transport",
                format!(
                    "unknown transport `{other}` (allowed: {})",
                    TransportKind::ALLOWED.join(", ")
                ),
            )),
        }
    }
}

impl<'de> Deserialize<'de> for TransportKind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = String::deserialize(deserializer)?;
        value.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for TransportKind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Settings of the transport layer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// Which transport to use. Default `tcp`: it works on every host.
    pub kind: TransportKind,
    /// Largest message accepted or sent, in bytes. Default 64 MiB: large
    /// enough for a Fetch response of a few hundred thousand 64-dim rows, and
    /// small enough that a hostile length prefix cannot make a server
    /// allocate unbounded memory (the size is checked before allocating).
    pub max_message_size: u64,
    /// Messages that may wait in a connection's send queue before `send`
    /// waits. Default 1024: deep enough to keep the socket busy while a
    /// writer batches, shallow enough to push back on a runaway producer.
    pub send_queue_depth: usize,
    /// Most bytes the TCP writer task gathers into one `writev` when
    /// messages queue (a message sent while the socket is free is written
    /// by its caller at once). Default 1 MiB: batches many small messages
    /// into one system call without delaying the first of them behind
    /// megabytes of others.
    pub write_batch_bytes: usize,
    /// Size of the pool buffers a connection reads into. Default 64 KiB:
    /// many small messages are read with one `read` and handed out as
    /// slices of that buffer without a copy; a message larger than half of
    /// it is read straight into a buffer of its own size.
    pub read_buffer_bytes: usize,
    /// The pool that outgoing messages are encoded into (local access only).
    pub send_pool: PoolConfig,
    /// The pool that incoming messages are received into (remotely writable
    /// on RDMA).
    pub recv_pool: PoolConfig,
    /// Settings of the RDMA transport (used when `kind = "rdma"`).
    pub rdma: RdmaConfig,
    /// Limits of accepted connections: the budget of incomplete inbound
    /// messages, timeouts of slow senders, the connection cap (see
    /// [`crate::inbound`]).
    pub inbound: InboundConfig,
    /// Mutual TLS on every connection (TCP frames and the RDMA handshake);
    /// the `[transport.tls]` table turns it on. Default off: see
    /// [`crate::tls`].
    pub tls: Option<TlsConfig>,
}

/// Which verbs provider the RDMA transport uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RdmaProvider {
    /// libibverbs: real RNICs and Soft-RoCE. The default, because the soft
    /// provider must only ever be chosen on purpose.
    #[default]
    Ibverbs,
    /// The software RNIC (for hosts without RDMA: between threads and
    /// processes of one host, over shared memory).
    Soft,
}

/// What drives the RDMA completion queues, and how it waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Polling {
    /// A dedicated I/O thread per queue: polls for `spin_us`, then sleeps
    /// until a completion or a message to send arrives.
    Event,
    /// A dedicated I/O thread per queue that never sleeps.
    Busy,
    /// No I/O thread: a task of the application's tokio runtime drives
    /// each queue, woken by the queue's notification descriptor, and a
    /// sending task posts on its own thread when the queue's worker is
    /// free. Needs a tokio runtime with I/O enabled. The default.
    #[default]
    Runtime,
}

/// Settings of the RDMA transport.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RdmaConfig {
    /// `ibverbs` or `soft`. Default `ibverbs`.
    pub provider: RdmaProvider,
    /// Device name (ibverbs); default: the first device. One rail; for
    /// several see `devices`.
    pub device: Option<String>,
    /// The rails (ibverbs): devices, each a rail, `["mlx5_0", "mlx5_1"]`,
    /// or `"all"` (every device whose `port` is active, in the kernel's
    /// order). Every pool is registered on each (one registration per
    /// device), so any buffer may go out on any rail. A connection goes to
    /// the rail with the fewest live connections to its address, passing
    /// over one whose port is down or whose handshake fails; a port going down fails that rail's connections,
    /// and the RPC layer's reconnect lands on another rail before TCP
    /// (`rdma/rails.rs`).
    /// Default: unset, one rail (`device`); not together with `device`.
    /// At most 8. One connection uses one rail (striping a connection's
    /// large messages over rails is not built yet).
    pub devices: Option<Devices>,
    /// Port of the device. Default 1 (the first port).
    pub port: u8,
    /// GID table entry (RoCE). Default: picked — a RoCE v2 entry of an
    /// IPv4 address, else any RoCE v2 one, else any filled one (index 0 is
    /// often the link-local RoCE v1 GID). An empty entry is refused.
    pub gid_index: Option<u8>,
    /// Traffic class of RoCE packets (their GRH: DSCP and ECN bits, for
    /// fabrics whose QoS classes RDMA by it). Default 0.
    pub traffic_class: u8,
    /// Send queue depth, and the engine's work-request ring. Default 32
    /// (the paper's).
    pub send_queue_depth: u32,
    /// Receive queue depth d (credits are returned in batches of d/2).
    /// Default 64: twice the send depth, so a peer's full ring of SENDs
    /// never waits for credits on an idle receiver.
    pub recv_queue_depth: u32,
    /// Messages up to this size go by SEND. Default 8 KiB.
    pub small_message_limit: usize,
    /// Largest WRITE fragment of a large message, and the unit the fragment
    /// scheduler interleaves sockets by. Default 64 KiB: the fastest in
    /// `tessera-bench transport` (8 KiB–128 KiB swept).
    pub fragment_size: usize,
    /// Completion queues, each with its driver (a runtime task or an I/O
    /// thread, by `polling`) and the engines assigned to it round robin.
    /// Default 2: two queues' work can run on two cores at once, and under
    /// `event` one thread per core on small hosts leaves the rest to the
    /// application; raise on big servers.
    pub io_threads: usize,
    /// What drives the completion queues: `event` (an I/O thread per
    /// queue that keeps polling `spin_us` after its last work, then sleeps
    /// until a completion or a message to send: an idle server uses no
    /// CPU), `busy` (an I/O thread that never sleeps: a core per thread
    /// spent), or `runtime` (no I/O thread: the application's tokio
    /// runtime drives the queues, woken by their notification
    /// descriptors, and senders post on their own thread; no thread hop
    /// per message). Default `runtime`: on a 2-core host it has a half to
    /// a third of `event`'s context switches in the parameter-server
    /// workloads, is level with or ahead of it on their latency, throughput
    /// and CPU, and carries more 512-byte messages per second at every
    /// queue-pair count from 1 to 256 (docs/src/performance.md, "Which driver"). `event` or
    /// `busy` threads are for hosts with cores to spare for them, and for
    /// applications that create the transport outside a tokio runtime
    /// (with `runtime` that is refused, naming this setting).
    pub polling: Polling,
    /// The spin budget: microseconds an `event` thread keeps polling after
    /// its last work before it sleeps. Default 50: the answer to a small
    /// request on a fabric comes within it (no sleep and wake-up on the
    /// critical path), and a thread with nothing to do stops spinning soon.
    pub spin_us: u64,
    /// Logical connections to one address share one queue pair (§6.1).
    /// Default true; false gives every `connect` a QP of its own.
    pub multiplex: bool,
    /// Send window: bytes posted and not completed per engine (§6.3); 0
    /// turns it off. Default 0: the window is for incast-prone fleets on
    /// lossless fabrics, where it keeps PFC quiet; the paper's deployment
    /// uses a few to tens of KiB.
    pub window_bytes: usize,
    /// Whether the window adapts to completion delay (never above
    /// `window_bytes`). Default false.
    pub window_adaptive: bool,
    /// Completion delay above which an adaptive window shrinks, in
    /// microseconds. Default 100.
    pub window_target_delay_us: u64,
    /// Keepalive write interval, in milliseconds. Default 1000.
    pub keepalive_interval_ms: u64,
    /// A peer whose keepalive stands still this long is dead, in
    /// milliseconds; 0 turns keepalive off. Default 10000: ten intervals,
    /// far above scheduling hiccups, well below the minute an operator
    /// would otherwise wait.
    pub keepalive_timeout_ms: u64,
    /// How long a peer may leave the destinations it was granted (a CTS
    /// sent for its request to send) unwritten, in milliseconds: once no
    /// large message has arrived for this long while a grant is out, the
    /// connection fails, and the grants' memory and inbound budget go with
    /// it (once its queue pair is in error, so no late write lands in
    /// reused memory). Default 30000: a granted message waits at most for
    /// its socket's earlier ones (each socket asks at most 4 ahead, so
    /// 4 x `max_message_size`, 256 MiB by default: 0.2 s at 10 Gb/s, 20 s
    /// at 100 Mb/s), and the peer starts writing as soon as it has the
    /// CTS; a peer that wrote nothing for 30 s holds the budget other
    /// peers need. At least 1000, at most 3600000.
    pub grant_timeout_ms: u64,
    /// Shared receive queues (§6.2.2): each I/O thread posts one queue of
    /// `srq_depth` receives that all its QPs take from, instead of a queue
    /// of `recv_queue_depth` per QP. Memory no longer grows with the number
    /// of peers, but there is no per-peer bound any more: receive credits
    /// are off, a burst from many peers can find the queue empty, and the
    /// sender's QP then retries after a receiver-not-ready NAK (counted in
    /// `rnr_events`) instead of waiting for credits. Default false.
    pub srq: bool,
    /// Receives of each shared receive queue. Default 4096: the receive
    /// queues of 64 dedicated-mode QPs.
    pub srq_depth: u32,
    /// Entries of each I/O thread's completion queue. Default 32768: room
    /// for the receives of 256 QPs at the default depth, plus sends;
    /// clamped to the device's `max_cqe` (rxe: 32767), with a log line. The
    /// queue depths, `srq_depth` and `io_threads` are checked against the
    /// device too, and a value it cannot hold fails the start naming its
    /// key (`auto` uses TCP instead).
    pub cq_depth: u32,
    /// Faults the soft provider injects (`[rdma.soft_faults]`: `seed`,
    /// `rnr_per_million`, `qp_error_per_million`, `delay_per_million`,
    /// `max_delay_polls`, `post_error_per_million`, `recv_error_per_million`),
    /// for fault drills. Default: none.
    pub soft_faults: crate::verbs::soft::SoftFaults,
    /// Soft provider only: the device's port is down while this file
    /// exists (looked at every 10 ms), as an RNIC with its cable pulled:
    /// every RDMA connection of the process fails and none can be made,
    /// while TCP to the same host keeps working. A drill's way to break a
    /// server's RDMA path from outside the process (`touch` it, `rm` it).
    /// Default: none.
    pub soft_port_file: Option<std::path::PathBuf>,
    /// Soft provider only: the rate of the device's link, each way, in
    /// megabits per second; 0 (the default): unlimited, a copy in memory.
    /// A SEND or WRITE waits in its send queue until the sender's and the
    /// receiver's links are free (see `verbs/soft/port.rs`), so many
    /// senders into one limited port queue as they would behind a real
    /// one: the incast a send window (`window_bytes`) is for.
    pub soft_link_mbps: u64,
    /// Soft provider only: several soft devices, each a rail with its own
    /// link and port (`[[rdma.soft_rails]]` tables of `link_mbps` and
    /// `port_file`, meaning what `soft_link_mbps` and `soft_port_file` mean
    /// for one device), so that tests and drills on one host exercise
    /// rails as `devices` does on a host with several NICs. Default: empty,
    /// one device from `soft_link_mbps` and `soft_port_file`; not together
    /// with them. At most 8.
    pub soft_rails: Vec<SoftRail>,
    /// Confine what a peer may write to what it was granted: each large
    /// message's destination is exposed through a type-2 memory window
    /// bound on that connection's queue pair to exactly its bytes, and
    /// invalidated before the message is handed on (so a peer can write
    /// neither into other connections' buffers, nor other peers'
    /// keepalive slots, nor memory freed and reused; see
    /// `rdma/windows.rs`). The receive pool is then registered without
    /// remote access. Default true: any process that reaches a port could
    /// otherwise write into every receive buffer of the pool. A device
    /// without type-2 windows refuses to start, naming this key; false
    /// restores one remotely writable registration per pool block, which
    /// saves a bind and an invalidation per large message (the transport
    /// benchmark's `confinement` rows measure it).
    pub confine_remote_writes: bool,
    /// Memory windows per connection (with `confine_remote_writes`): large
    /// messages a peer may be granted at once, plus its keepalive slot. A
    /// request to send beyond waits for one to come back, as one beyond
    /// the byte budget does. Default 16: four sockets' `rts_ahead` of 4 in
    /// flight, far beyond what keeps a link busy with 64 KiB fragments.
    pub windows_per_connection: u32,
    /// With several rails: a large message of at least this many bytes is
    /// striped, its bytes written through the queue pairs of every rail to
    /// the peer at once (`rdma/engine/stripes.rs`), so that one busy
    /// connection uses every link. Needs `confine_remote_writes = false`
    /// (a memory window is bound on one queue pair, and the peer's other
    /// rails could not write through it): confined, connections spread
    /// over rails but each message stays on one. 0 turns striping off.
    /// Default 256 KiB: below it, handing chunks to another rail's I/O
    /// driver and back costs more than the bytes it moves.
    pub stripe_min_bytes: usize,
    /// Bytes of each chunk a striped message hands to another rail (each
    /// rail has two at once and takes the next as one completes, so rails
    /// share a message in proportion to what they carry). Default 128 KiB:
    /// a 1 MiB message gives each of 4 rails about two. At least 1024 (a
    /// chunk is written in fragments of at most `fragment_size`).
    pub stripe_chunk_bytes: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            provider: RdmaProvider::Ibverbs,
            device: None,
            devices: None,
            port: 1,
            gid_index: None,
            traffic_class: 0,
            send_queue_depth: 32,
            recv_queue_depth: 64,
            small_message_limit: 8 << 10,
            fragment_size: 64 << 10,
            io_threads: 2,
            polling: Polling::Runtime,
            spin_us: 50,
            multiplex: true,
            window_bytes: 0,
            window_adaptive: false,
            window_target_delay_us: 100,
            keepalive_interval_ms: 1000,
            keepalive_timeout_ms: 10_000,
            grant_timeout_ms: 30_000,
            srq: false,
            srq_depth: 4096,
            cq_depth: 32768,
            soft_faults: crate::verbs::soft::SoftFaults::default(),
            soft_port_file: None,
            soft_link_mbps: 0,
            soft_rails: Vec::new(),
            confine_remote_writes: true,
            windows_per_connection: 16,
            stripe_min_bytes: 256 << 10,
            stripe_chunk_bytes: 128 << 10,
        }
    }
}

/// `[rdma] devices`: which devices are rails.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// `"all"`: every device whose port is active.
    All(AllDevices),
    /// These devices, in this order (the first is the primary rail).
    Named(Vec<String>),
}

/// The word `all` of [`Devices::All`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllDevices {
    /// Every device with an active port.
    All,
}

/// One soft device of `[[rdma.soft_rails]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SoftRail {
    /// Its link's rate each way in megabits per second; 0: unlimited.
    pub link_mbps: u64,
    /// Its port is down while this file exists (looked at every 10 ms).
    pub port_file: Option<std::path::PathBuf>,
}

/// Rails a transport may have at most (devices a pool registers on).
pub const MAX_RAILS: usize = crate::pool::MAX_RAILS;

impl RdmaConfig {
    /// How many rails this configuration asks for, where that is known
    /// without looking at the host (`None`: `devices = "all"`).
    pub fn rail_count(&self) -> Option<usize> {
        match (&self.provider, &self.devices) {
            (RdmaProvider::Soft, _) => Some(self.soft_rails.len().max(1)),
            (_, Some(Devices::All(_))) => None,
            (_, Some(Devices::Named(names))) => Some(names.len()),
            (_, None) => Some(1),
        }
    }

    fn validate_rails(&self) -> Result<(), ConfigError> {
        if let Some(devices) = &self.devices {
            if self.device.is_some() {
                return Err(invalid(
                    "devices",
                    "set `device` (one rail) or `devices` (several), not both",
                ));
            }
            if self.provider == RdmaProvider::Soft {
                return Err(invalid(
                    "devices",
                    "names ibverbs devices; soft rails are `[[rdma.soft_rails]]`",
                ));
            }
            if let Devices::Named(names) = devices {
                if names.is_empty() || names.len() > MAX_RAILS {
                    return Err(invalid(
                        "devices",
                        format!("must name 1 to {MAX_RAILS} devices, or be \"all\""),
                    ));
                }
                let mut seen = std::collections::HashSet::new();
                if let Some(twice) = names.iter().find(|name| !seen.insert(name.as_str())) {
                    return Err(invalid("devices", format!("names {twice:?} twice")));
                }
            }
        }
        if !self.soft_rails.is_empty() {
            if self.soft_rails.len() > MAX_RAILS {
                return Err(invalid("soft_rails", format!("at most {MAX_RAILS} rails")));
            }
            if self.soft_link_mbps != 0 || self.soft_port_file.is_some() {
                return Err(invalid(
                    "soft_rails",
                    "each rail has its own `link_mbps` and `port_file`: leave `soft_link_mbps` and `soft_port_file` unset",
                ));
            }
        }
        Ok(())
    }
}

impl Validate for RdmaConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_rails()?;
        if self.send_queue_depth < 2 {
            return Err(invalid("send_queue_depth", "must be at least 2"));
        }
        if self.recv_queue_depth < 4 {
            return Err(invalid("recv_queue_depth", "must be at least 4"));
        }
        if self.small_message_limit == 0 {
            return Err(invalid("small_message_limit", "must be at least 1"));
        }
        if self.stripe_min_bytes > 0 && self.stripe_chunk_bytes < 1024 {
            return Err(invalid("stripe_chunk_bytes", "must be at least 1024"));
        }
        if self.fragment_size < 1024 {
            return Err(invalid("fragment_size", "must be at least 1024"));
        }
        if self.io_threads == 0 || self.io_threads > 256 {
            return Err(invalid("io_threads", "must be between 1 and 256"));
        }
        if self.window_bytes != 0 && self.window_bytes < 1024 {
            return Err(invalid("window_bytes", "must be 0 (off) or at least 1024"));
        }
        if self.keepalive_timeout_ms != 0 && self.keepalive_interval_ms == 0 {
            return Err(invalid("keepalive_interval_ms", "must be at least 1"));
        }
        if self.keepalive_timeout_ms != 0
            && self.keepalive_timeout_ms < 2 * self.keepalive_interval_ms
        {
            return Err(invalid(
                "keepalive_timeout_ms",
                "must be 0 (off) or at least twice keepalive_interval_ms",
            ));
        }
        if !(1000..=3_600_000).contains(&self.grant_timeout_ms) {
            return Err(invalid(
                "grant_timeout_ms",
                "must be between 1000 and 3600000 (an hour)",
            ));
        }
        if self.srq && self.srq_depth < 16 {
            return Err(invalid("srq_depth", "must be at least 16"));
        }
        if self.confine_remote_writes && !(2..=1024).contains(&self.windows_per_connection) {
            return Err(invalid(
                "windows_per_connection",
                "must be between 2 (a grant and the keepalive slot) and 1024",
            ));
        }
        if self.cq_depth < 256 {
            return Err(invalid("cq_depth", "must be at least 256"));
        }
        // A thread's CQ holds its shared receive queue's completions and at
        // least one connection's (see `rdma/cq_budget.rs`).
        let one = self.send_queue_depth + if self.srq { 0 } else { self.recv_queue_depth };
        let fixed = if self.srq { self.srq_depth } else { 0 };
        if u64::from(fixed) + u64::from(one) > u64::from(self.cq_depth) {
            return Err(invalid(
                "cq_depth",
                format!(
                    "{} cannot hold one connection ({one} entries){}",
                    self.cq_depth,
                    if self.srq {
                        format!(" beside the shared receive queue ({fixed})")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        Ok(())
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            kind: TransportKind::Tcp,
            max_message_size: 64 << 20,
            send_queue_depth: 1024,
            write_batch_bytes: 1 << 20,
            read_buffer_bytes: 64 << 10,
            send_pool: PoolConfig::named("send"),
            recv_pool: PoolConfig::named("recv"),
            rdma: RdmaConfig::default(),
            inbound: InboundConfig::default(),
            tls: None,
        }
    }
}

impl TransportConfig {
    /// Largest value allowed for `max_message_size` (the TCP frame length is
    /// a u32).
    pub const MAX_MESSAGE_SIZE_LIMIT: u64 = u32::MAX as u64;

    /// The defaults with `kind = "rdma"` over the soft provider (hosts
    /// without an RNIC, tests).
    pub fn soft_rdma() -> Self {
        Self {
            kind: TransportKind::Rdma,
            rdma: RdmaConfig {
                provider: RdmaProvider::Soft,
                ..RdmaConfig::default()
            },
            ..Self::default()
        }
    }
}

impl Validate for TransportConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_message_size == 0 || self.max_message_size > Self::MAX_MESSAGE_SIZE_LIMIT {
            return Err(invalid(
                "max_message_size",
                format!(
                    "{} is outside 1..={}",
                    self.max_message_size,
                    Self::MAX_MESSAGE_SIZE_LIMIT
                ),
            ));
        }
        if self.send_queue_depth == 0 {
            return Err(invalid("send_queue_depth", "must be at least 1"));
        }
        if self.write_batch_bytes == 0 {
            return Err(invalid("write_batch_bytes", "must be at least 1"));
        }
        if self.read_buffer_bytes < 64 {
            return Err(invalid(
                "read_buffer_bytes",
                format!("{} is below the minimum of 64", self.read_buffer_bytes),
            ));
        }
        prefixed("send_pool", self.send_pool.validate())?;
        prefixed("recv_pool", self.recv_pool.validate())?;
        prefixed("rdma", self.rdma.validate())?;
        // mlx5 binds a memory window over at most 2 GiB: a confined grant
        // of a larger message would fail its connection.
        if self.kind != TransportKind::Tcp
            && self.rdma.confine_remote_writes
            && self.max_message_size > MAX_WINDOW_BYTES
        {
            return Err(invalid(
                "max_message_size",
                format!(
                    "{} is above {MAX_WINDOW_BYTES}, the most a memory window can cover on some \
                     RNICs (mlx5); lower it, or set rdma.confine_remote_writes = false",
                    self.max_message_size
                ),
            ));
        }
        prefixed("inbound", self.inbound.validate_for(self.max_message_size))?;
        match &self.tls {
            Some(tls) => prefixed("tls", tls.validate()),
            None => Ok(()),
        }
    }
}

/// The largest memory window binding some RNICs take (mlx5: 2 GiB).
const MAX_WINDOW_BYTES: u64 = 2 << 30;

/// Puts `table.` in front of the key an error names.
fn prefixed(table: &str, result: Result<(), ConfigError>) -> Result<(), ConfigError> {
    result.map_err(|err| match err {
        ConfigError::Invalid { key, reason } => invalid(format!("{table}.{key}"), reason),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_transport_names_the_setting_and_allowed_values() {
        let err = "udp".parse::<TransportKind>().unwrap_err().to_string();
        assert!(err.contains("`transport`"), "{err}");
        assert!(err.contains("allowed: tcp, rdma, auto"), "{err}");
        assert_eq!(
            "auto".parse::<TransportKind>().unwrap(),
            TransportKind::Auto
        );
        assert_eq!(
            "rdma".parse::<TransportKind>().unwrap(),
            TransportKind::Rdma
        );
    }

    #[test]
    fn rails_are_named_devices_all_or_soft_rails() {
        let rdma = |text: &str| toml::from_str::<RdmaConfig>(text).unwrap();
        let two = rdma("devices = [\"mlx5_0\", \"mlx5_1\"]");
        assert_eq!(
            two.devices,
            Some(Devices::Named(vec!["mlx5_0".into(), "mlx5_1".into()]))
        );
        assert_eq!(two.rail_count(), Some(2));
        assert!(two.validate().is_ok());
        let all = rdma("devices = \"all\"");
        assert_eq!(all.devices, Some(Devices::All(AllDevices::All)));
        assert_eq!(all.rail_count(), None);
        assert!(toml::from_str::<RdmaConfig>("devices = \"some\"").is_err());
        let soft = rdma(
            "provider = \"soft\"\n[[soft_rails]]\nlink_mbps = 1000\n[[soft_rails]]\nport_file = \"/tmp/p\"",
        );
        assert_eq!(soft.rail_count(), Some(2));
        assert_eq!(soft.soft_rails[0].link_mbps, 1000);
        assert!(soft.validate().is_ok());
        assert_eq!(RdmaConfig::default().rail_count(), Some(1));
        // A round trip keeps them.
        let text = toml::to_string(&soft).unwrap();
        assert_eq!(toml::from_str::<RdmaConfig>(&text).unwrap(), soft);
    }

    #[test]
    fn rail_settings_that_contradict_are_refused_naming_the_key() {
        let key = |rdma: RdmaConfig| {
            let config = TransportConfig {
                rdma,
                ..TransportConfig::default()
            };
            config.validate().unwrap_err().key().map(str::to_owned)
        };
        let named = |names: &[&str]| {
            Some(Devices::Named(
                names.iter().map(|n| n.to_string()).collect(),
            ))
        };
        let cases = [
            RdmaConfig {
                device: Some("mlx5_0".into()),
                devices: named(&["mlx5_1"]),
                ..RdmaConfig::default()
            },
            RdmaConfig {
                devices: named(&[]),
                ..RdmaConfig::default()
            },
            RdmaConfig {
                devices: named(&["a", "b", "a"]),
                ..RdmaConfig::default()
            },
            RdmaConfig {
                devices: named(&["a"; 9]),
                ..RdmaConfig::default()
            },
            RdmaConfig {
                provider: RdmaProvider::Soft,
                devices: Some(Devices::All(AllDevices::All)),
                ..RdmaConfig::default()
            },
        ];
        for case in cases {
            assert_eq!(
                key(case.clone()).as_deref(),
                Some("rdma.devices"),
                "{case:?}"
            );
        }
        let soft = |rails: usize, link: u64| RdmaConfig {
            provider: RdmaProvider::Soft,
            soft_rails: vec![SoftRail::default(); rails],
            soft_link_mbps: link,
            ..RdmaConfig::default()
        };
        assert_eq!(key(soft(9, 0)).as_deref(), Some("rdma.soft_rails"));
        assert_eq!(key(soft(2, 100)).as_deref(), Some("rdma.soft_rails"));
        assert!(soft(8, 0).validate().is_ok());
        let chunk = |min: usize, chunk: usize| RdmaConfig {
            stripe_min_bytes: min,
            stripe_chunk_bytes: chunk,
            ..RdmaConfig::default()
        };
        assert_eq!(
            key(chunk(256 << 10, 512)).as_deref(),
            Some("rdma.stripe_chunk_bytes")
        );
        // Striping off: the chunk size is not looked at; a chunk below a
        // fragment is written as one WRITE.
        assert!(chunk(0, 0).validate().is_ok());
        let one_write = RdmaConfig {
            fragment_size: 64 << 20,
            ..RdmaConfig::default()
        };
        assert!(one_write.validate().is_ok());
        for ms in [0, 999, 3_600_001] {
            let grant = RdmaConfig {
                grant_timeout_ms: ms,
                ..RdmaConfig::default()
            };
            assert_eq!(key(grant).as_deref(), Some("rdma.grant_timeout_ms"), "{ms}");
        }
    }

    #[test]
    fn confinement_caps_the_message_size_at_a_windows_reach() {
        let big = TransportConfig {
            max_message_size: 3 << 30,
            inbound: InboundConfig {
                max_bytes: 4 << 30,
                max_connection_bytes: 4 << 30,
                max_address_bytes: 4 << 30,
                ..InboundConfig::default()
            },
            ..TransportConfig::soft_rdma()
        };
        let err = big.validate().unwrap_err();
        assert_eq!(err.key(), Some("max_message_size"));
        let open = TransportConfig {
            rdma: RdmaConfig {
                confine_remote_writes: false,
                ..big.rdma.clone()
            },
            ..big.clone()
        };
        assert!(open.validate().is_ok());
        let tcp = TransportConfig {
            kind: TransportKind::Tcp,
            ..big
        };
        assert!(tcp.validate().is_ok());
    }

    #[test]
    fn defaults_validate_and_zero_limits_do_not() {
        TransportConfig::default().validate().unwrap();
        let config = TransportConfig {
            max_message_size: 0,
            ..TransportConfig::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("max_message_size"), "{err}");
    }
}
