//! `tessera-bench rpc`: the parameter-server service end to end, as a
//! user would call it, against what they would otherwise pick.
//!
//! One `ParameterServer` (a real `PsServer` with a table of dim 64) runs in
//! a child process per transport and serves two calls: a Fetch of 1,000
//! keys (256,000 bytes of rows back) and an empty Health. The client
//! process calls it four ways, interleaved in rounds so that drift of the
//! machine hits every way alike:
//!
//! - **tessera-tcp** and **tessera-rdma-soft**: Tessera RPC (the generated
//!   `ParameterServerClient` over a `Channel`);
//! - **grpc-tuned**: a stock tonic client generated from the same
//!   `ps.proto` (`tonic-prost-build`, nothing of Tessera's) against the
//!   server's gRPC endpoint, a tonic server, set up as an experienced gRPC
//!   user sets it for large answers: HTTP/2 windows of 8 MiB per stream
//!   and 32 MiB per connection, and as many connections as Tessera's
//!   channel (its callers spread over them); `TCP_NODELAY` on both sides,
//!   as tonic's docs recommend. The like-for-like baseline: the headline
//!   ratios are to it.
//! - **grpc**: the same client with tonic's defaults (one connection,
//!   HTTP/2's 64 KiB windows), what a user gets without tuning, labelled
//!   as such beside it;
//! - **floor**: a bare TCP ping-pong of the same bytes (the encoded
//!   request out, the encoded response back) with an echo process that
//!   writes each answer with one `write`: what any stack over TCP pays.
//!
//! With `TESSERA_BENCH_PROMETHEUS=1` in the environment both processes
//! install the Prometheus recorder first, as the `ps-server` and `worker`
//! binaries do with `metrics_listen`: the cost of metrics as a fleet runs
//! them (without it, every `metrics` call is a no-op).
//!
//! Latency is measured with one call outstanding (p50, p99, p999, mean);
//! throughput with `concurrency` callers sharing one client (the floor:
//! one connection each), as calls per second. Every figure is also a ratio
//! to gRPC's and to the floor's of the same run.

use std::io::{BufRead, Write as _};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tessera_proto::v1 as ps;
use tessera_rpc::{Channel, ChannelConfig, TransportKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::report::{Meta, quantile};
use crate::transport::BoxError;

/// The stock tonic client of `ps.proto`.
#[allow(missing_docs, dead_code, clippy::all)]
pub mod grpc {
    include!(concat!(env!("OUT_DIR"), "/grpc/tessera.ps.v1.rs"));
}

/// Keys per Fetch.
pub const FETCH_KEYS: usize = 1000;
/// The table's dimension.
pub const DIM: u32 = 64;
pub(crate) const TABLE: &str = "emb";

/// What a run measures.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Measured calls per way and call for latency, over all rounds.
    pub iterations: usize,
    /// Seconds per way and call of throughput, over all rounds.
    pub throughput_secs: f64,
    /// Callers outstanding in the throughput runs.
    pub concurrency: usize,
    /// Connections of Tessera's channel (`ChannelConfig::connections`):
    /// its callers share one channel, as a worker's do; the floor gives
    /// each caller a connection of its own.
    pub connections: usize,
    /// Interleaved rounds.
    pub rounds: usize,
    /// The calls measured (default both).
    pub calls: Vec<Call>,
    /// The ways measured (default all; a ratio whose baseline way is not
    /// measured is left out).
    pub ways: Vec<Way>,
}

impl Plan {
    /// The full run, or a smoke run.
    pub fn new(quick: bool) -> Self {
        match quick {
            false => Self {
                iterations: 5000,
                throughput_secs: 6.0,
                concurrency: 32,
                connections: 16,
                rounds: 5,
                calls: Call::ALL.to_vec(),
                ways: Way::ALL.to_vec(),
            },
            true => Self {
                iterations: 300,
                throughput_secs: 0.6,
                concurrency: 16,
                connections: 4,
                rounds: 2,
                calls: Call::ALL.to_vec(),
                ways: Way::ALL.to_vec(),
            },
        }
    }
}

/// The ways a call is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// Bare TCP ping-pong of the same bytes.
    Floor,
    /// Tessera RPC over TCP.
    TesseraTcp,
    /// Tessera RPC over RDMA on the soft RNIC.
    TesseraRdma,
    /// tonic gRPC on both sides, windows of 8/32 MiB and Tessera's
    /// connection count (the like-for-like baseline).
    GrpcTuned,
    /// tonic gRPC on both sides with tonic's defaults.
    Grpc,
}

impl Way {
    /// Every way, in table order.
    pub const ALL: [Way; 5] = [
        Way::Floor,
        Way::TesseraTcp,
        Way::TesseraRdma,
        Way::GrpcTuned,
        Way::Grpc,
    ];

    /// The row label.
    pub fn label(self) -> &'static str {
        match self {
            Way::Floor => "floor (bare TCP)",
            Way::TesseraTcp => "tessera-tcp",
            Way::TesseraRdma => "tessera-rdma-soft",
            Way::GrpcTuned => "grpc-tuned (tonic, 8/32 MiB windows, same connections)",
            Way::Grpc => "grpc (tonic defaults)",
        }
    }
}

impl std::str::FromStr for Way {
    type Err = String;

    /// `floor`, `tessera-tcp`, `tessera-rdma-soft`, `grpc-tuned` or `grpc`.
    fn from_str(name: &str) -> Result<Self, String> {
        Way::ALL
            .into_iter()
            .find(|w| w.label().split(' ').next() == Some(name))
            .ok_or_else(|| {
                format!("{name:?}: one of floor, tessera-tcp, tessera-rdma-soft, grpc-tuned, grpc")
            })
    }
}

/// The calls measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Fetch of [`FETCH_KEYS`] keys.
    Fetch,
    /// An empty Health.
    Health,
}

impl Call {
    /// Both calls.
    pub const ALL: [Call; 2] = [Call::Fetch, Call::Health];

    /// The row label (`fetch`, `health`).
    pub fn label(self) -> &'static str {
        match self {
            Call::Fetch => "fetch",
            Call::Health => "health",
        }
    }
}

impl std::str::FromStr for Call {
    type Err = String;

    /// `fetch` or `health`.
    fn from_str(name: &str) -> Result<Self, String> {
        Call::ALL
            .into_iter()
            .find(|c| c.label() == name)
            .ok_or_else(|| format!("{name:?}: fetch or health"))
    }
}

fn keys() -> Vec<u64> {
    (0..FETCH_KEYS as u64)
        .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect()
}

/// A ps-server child process; killed when dropped.
pub(crate) struct ServerChild {
    pub(crate) child: Child,
    pub(crate) tessera: String,
    grpc: String,
}

impl Drop for ServerChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tessera-bench <command>` and reads its `ready <addr>...` line.
fn spawn_ready(args: &[&str]) -> Result<(Child, Vec<String>), BoxError> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("the child's stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    let mut words = line.split_whitespace();
    if words.next() != Some("ready") {
        let _ = child.kill();
        return Err(format!("{args:?} did not start: {line:?}").into());
    }
    let addrs = words.map(str::to_owned).collect();
    Ok((child, addrs))
}

fn start_server(kind: TransportKind) -> Result<ServerChild, BoxError> {
    start_server_of(kind, DIM)
}

/// A `rpc-ps-server` child on `kind` whose table `emb` has `dim` values
/// per row.
pub(crate) fn start_server_of(kind: TransportKind, dim: u32) -> Result<ServerChild, BoxError> {
    let dim = dim.to_string();
    let (child, addrs) = spawn_ready(&["rpc-ps-server", kind.as_str(), "--dim", &dim])?;
    let [tessera, grpc] =
        <[String; 2]>::try_from(addrs).map_err(|a| format!("rpc-ps-server printed {a:?}"))?;
    Ok(ServerChild {
        child,
        tessera,
        grpc,
    })
}

/// The `rpc-ps-server` child: a ps-server of one shard with table `emb`
/// (`dim` values per row) on `kind`, its gRPC endpoint on, both on
/// loopback ports of its choosing, printed as `ready <tessera> <grpc>`;
/// serves until its stdin closes (the parent is gone) or SIGTERM. Every
/// benchmark client runs on this host, so one address may hold as many
/// connections as the listener (the default per-address cap, 256, is
/// meant for a fleet of client hosts).
pub async fn ps_server_child(kind: TransportKind, dim: u32) -> Result<(), BoxError> {
    use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
    install_recorder_if_asked()?;
    let defaults = PsServerConfig::default();
    let config = PsServerConfig {
        listen: "127.0.0.1:0".into(),
        grpc_listen: Some("127.0.0.1:0".into()),
        transport: kind,
        rdma: tessera_transport::TransportConfig::soft_rdma().rdma,
        tables: vec![TableConfig::new(TABLE, dim)],
        inbound: tessera_transport::InboundConfig {
            max_connections_per_address: defaults.inbound.max_connections,
            ..defaults.inbound.clone()
        },
        ..defaults
    };
    let server = PsServer::bind(&config).await?;
    let grpc = server.grpc_addr().ok_or("no gRPC endpoint")?;
    announce(&format!("ready {} {grpc}", server.local_addr()))?;
    server.serve(until_parent_gone()).await;
    Ok(())
}

#[allow(clippy::print_stdout)]
pub(crate) fn announce(line: &str) -> Result<(), BoxError> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// Resolves when stdin reaches its end (the parent closed it or died) or
/// on SIGTERM.
async fn until_parent_gone() {
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    });
    tokio::select! {
        _ = stdin_closed => {}
        () = tessera_rpc::shutdown_signal() => {}
    }
}

/// The `rpc-floor-server` child: for each frame `[request length u32 LE]
/// [answer length u32 LE][request]` it answers `[answer length][answer]`
/// with one write, on every connection; prints `ready <addr>`.
pub async fn floor_server_child() -> Result<(), BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    announce(&format!("ready {}", listener.local_addr()?))?;
    let serve = async {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                stream.set_nodelay(true)?;
                let mut request = Vec::new();
                let mut answer = Vec::new();
                loop {
                    let mut header = [0u8; 8];
                    if stream.read_exact(&mut header).await.is_err() {
                        return Ok::<_, std::io::Error>(());
                    }
                    let [a, b, c, d, e, f, g, h] = header;
                    request.resize(u32::from_le_bytes([a, b, c, d]) as usize, 0);
                    let answer_len = u32::from_le_bytes([e, f, g, h]) as usize;
                    stream.read_exact(&mut request).await?;
                    if answer.len() != 4 + answer_len {
                        answer = vec![7u8; 4 + answer_len];
                        answer[..4].copy_from_slice(&[e, f, g, h]);
                    }
                    stream.write_all(&answer).await?;
                }
            });
        }
    };
    tokio::select! {
        () = serve => {}
        () = until_parent_gone() => {}
    }
    Ok(())
}

/// One caller of one way.
enum Caller {
    Floor {
        stream: tokio::net::TcpStream,
        fetch: Arc<Vec<u8>>,
        fetch_answer: usize,
        health: Arc<Vec<u8>>,
        health_answer: usize,
        answer: Vec<u8>,
    },
    Tessera(ps::ParameterServerClient, Arc<Vec<u64>>),
    Grpc(
        grpc::parameter_server_client::ParameterServerClient<tonic::transport::Channel>,
        Arc<Vec<u64>>,
    ),
}

impl Caller {
    async fn call(&mut self, call: Call) -> Result<(), BoxError> {
        let want = FETCH_KEYS * DIM as usize * 4;
        match (self, call) {
            (
                Caller::Floor {
                    stream,
                    fetch,
                    fetch_answer,
                    health,
                    health_answer,
                    answer,
                },
                call,
            ) => {
                let (frame, len) = match call {
                    Call::Fetch => (fetch, *fetch_answer),
                    Call::Health => (health, *health_answer),
                };
                stream.write_all(frame).await?;
                answer.resize(4 + len, 0);
                stream.read_exact(answer).await?;
            }
            (Caller::Tessera(client, keys), Call::Fetch) => fetch(client, keys, DIM).await?,
            (Caller::Tessera(client, _), Call::Health) => {
                client.health(ps::HealthRequest {}).await?;
            }
            (Caller::Grpc(client, keys), Call::Fetch) => {
                let response = client
                    .fetch(grpc::FetchRequest {
                        table: TABLE.into(),
                        shard: 0,
                        keys: keys.to_vec(),
                    })
                    .await?
                    .into_inner();
                if response.values.len() != want {
                    return Err(format!("{} bytes of rows", response.values.len()).into());
                }
            }
            (Caller::Grpc(client, _), Call::Health) => {
                client.health(grpc::HealthRequest {}).await?;
            }
        }
        Ok(())
    }
}

/// A Tessera Fetch of `keys` from table `emb` (shard 0), checked to bring
/// back `dim` values per key.
pub(crate) async fn fetch(
    client: &ps::ParameterServerClient,
    keys: &[u64],
    dim: u32,
) -> Result<(), BoxError> {
    let response = client
        .fetch(ps::FetchRequest {
            table: TABLE.into(),
            shard: 0,
            keys: keys.to_vec(),
        })
        .await?;
    let want = keys.len() * dim as usize * 4;
    match response.values.len() == want {
        true => Ok(()),
        false => Err(format!("{} bytes of rows, not {want}", response.values.len()).into()),
    }
}

/// The frame the floor sends for a call: its header and the request's
/// bytes, and the answer's length.
fn floor_frame(request_len: usize, answer_len: usize) -> Result<Vec<u8>, BoxError> {
    let mut frame = Vec::with_capacity(8 + request_len);
    frame.extend_from_slice(&u32::try_from(request_len)?.to_le_bytes());
    frame.extend_from_slice(&u32::try_from(answer_len)?.to_le_bytes());
    frame.resize(8 + request_len, 3);
    Ok(frame)
}

/// Everything the client side needs to make callers of every way.
struct Targets {
    tcp: ServerChild,
    rdma: ServerChild,
    floor: Child,
    floor_addr: String,
    keys: Arc<Vec<u64>>,
    fetch: Arc<Vec<u8>>,
    fetch_answer: usize,
    health: Arc<Vec<u8>>,
    health_answer: usize,
}

impl Drop for Targets {
    fn drop(&mut self) {
        let _ = self.floor.kill();
        let _ = self.floor.wait();
    }
}

pub(crate) fn channel_config(kind: TransportKind) -> ChannelConfig {
    let mut config = ChannelConfig {
        connect_timeout_ms: 5000,
        request_timeout_ms: 30_000,
        ..ChannelConfig::default()
    };
    config.transport.kind = kind;
    config.transport.rdma = tessera_transport::TransportConfig::soft_rdma().rdma;
    config
}

impl Targets {
    async fn start() -> Result<Self, BoxError> {
        let tcp = start_server(TransportKind::Tcp)?;
        let rdma = start_server(TransportKind::Rdma)?;
        let (floor, addrs) = spawn_ready(&["rpc-floor-server"])?;
        let floor_addr = addrs
            .into_iter()
            .next()
            .ok_or("rpc-floor-server's address")?;
        let keys = Arc::new(keys());
        // The floor moves the bytes a call moves: the encoded request out
        // and the encoded response back (the Fetch creates the rows).
        let client = ps::ParameterServerClient::new(
            Channel::connect(tcp.tessera.clone(), channel_config(TransportKind::Tcp)).await?,
        );
        let request = ps::FetchRequest {
            table: TABLE.into(),
            shard: 0,
            keys: keys.to_vec(),
        };
        let fetched = client.fetch(request.clone()).await?;
        let health = client.health(ps::HealthRequest {}).await?;
        // The rdma server's rows too.
        ps::ParameterServerClient::new(
            Channel::connect(rdma.tessera.clone(), channel_config(TransportKind::Rdma)).await?,
        )
        .fetch(request.clone())
        .await?;
        use prost::Message as _;
        Ok(Self {
            tcp,
            rdma,
            floor,
            floor_addr,
            keys,
            fetch: Arc::new(floor_frame(request.encoded_len(), 0)?),
            fetch_answer: fetched.encoded_len(),
            health: Arc::new(floor_frame(0, 0)?),
            health_answer: health.encoded_len(),
        }
        .with_answer_lengths())
    }

    /// Writes the answer lengths into the floor's frames.
    fn with_answer_lengths(mut self) -> Self {
        for (frame, len) in [
            (&mut self.fetch, self.fetch_answer),
            (&mut self.health, self.health_answer),
        ] {
            let frame = Arc::make_mut(frame);
            frame[4..8].copy_from_slice(&(len as u32).to_le_bytes());
        }
        self
    }

    /// The server's gRPC endpoint, `TCP_NODELAY` on.
    fn grpc_endpoint(&self) -> Result<tonic::transport::Endpoint, BoxError> {
        Ok(
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.tcp.grpc))?
                .tcp_nodelay(true),
        )
    }

    /// `n` callers of `way` (one client shared, or a connection each for
    /// the floor).
    async fn callers(
        &self,
        way: Way,
        n: usize,
        connections: usize,
    ) -> Result<Vec<Caller>, BoxError> {
        let mut callers = Vec::with_capacity(n);
        match way {
            Way::Floor => {
                for _ in 0..n {
                    let stream = tokio::net::TcpStream::connect(&self.floor_addr).await?;
                    stream.set_nodelay(true)?;
                    callers.push(Caller::Floor {
                        stream,
                        fetch: Arc::clone(&self.fetch),
                        fetch_answer: self.fetch_answer,
                        health: Arc::clone(&self.health),
                        health_answer: self.health_answer,
                        answer: Vec::new(),
                    });
                }
            }
            Way::TesseraTcp | Way::TesseraRdma => {
                let (addr, kind) = match way {
                    Way::TesseraTcp => (&self.tcp.tessera, TransportKind::Tcp),
                    _ => (&self.rdma.tessera, TransportKind::Rdma),
                };
                let config = ChannelConfig {
                    connections,
                    ..channel_config(kind)
                };
                let client =
                    ps::ParameterServerClient::new(Channel::connect(addr.clone(), config).await?);
                for _ in 0..n {
                    callers.push(Caller::Tessera(client.clone(), Arc::clone(&self.keys)));
                }
            }
            Way::Grpc => {
                let channel = self.grpc_endpoint()?.connect().await?;
                let client = grpc::parameter_server_client::ParameterServerClient::new(channel)
                    .max_decoding_message_size(64 << 20);
                for _ in 0..n {
                    callers.push(Caller::Grpc(client.clone(), Arc::clone(&self.keys)));
                }
            }
            Way::GrpcTuned => {
                let mut clients = Vec::with_capacity(connections.max(1));
                for _ in 0..connections.max(1) {
                    let channel = self
                        .grpc_endpoint()?
                        .initial_stream_window_size(8 << 20)
                        .initial_connection_window_size(32 << 20)
                        .connect()
                        .await?;
                    clients.push(
                        grpc::parameter_server_client::ParameterServerClient::new(channel)
                            .max_decoding_message_size(64 << 20),
                    );
                }
                for i in 0..n {
                    let client = clients[i % clients.len()].clone();
                    callers.push(Caller::Grpc(client, Arc::clone(&self.keys)));
                }
            }
        }
        Ok(callers)
    }
}

/// What one way measured for one call, over all rounds.
#[derive(Debug, Default)]
struct Measured {
    /// Latencies with one outstanding, µs.
    latency_us: Vec<f64>,
    /// Calls per second of each round's throughput run.
    rates: Vec<f64>,
}

/// Latency with one call outstanding: `n` measured calls after a tenth
/// as many unmeasured.
async fn latency(
    caller: &mut Caller,
    call: Call,
    n: usize,
    out: &mut Vec<f64>,
) -> Result<(), BoxError> {
    for _ in 0..n.div_ceil(10) {
        caller.call(call).await?;
    }
    for _ in 0..n {
        let started = Instant::now();
        caller.call(call).await?;
        out.push(started.elapsed().as_secs_f64() * 1e6);
    }
    Ok(())
}

/// Calls per second of `callers` calling for `secs`.
async fn throughput(callers: Vec<Caller>, call: Call, secs: f64) -> Result<f64, BoxError> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut caller in callers {
        let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                caller.call(call).await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, BoxError>(())
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let calls = done.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(calls as f64 / elapsed)
}

/// Installs the Prometheus recorder when `TESSERA_BENCH_PROMETHEUS` is set
/// (see the module docs); the server child inherits the variable.
fn install_recorder_if_asked() -> Result<(), BoxError> {
    if std::env::var_os("TESSERA_BENCH_PROMETHEUS").is_some() {
        tessera_rpc::observe::install_prometheus("127.0.0.1:0")?;
    }
    Ok(())
}

/// Runs `plan` and returns its rows (one per call and way) and table.
pub async fn run(plan: &Plan, meta: &Meta) -> Result<(Vec<Value>, String), BoxError> {
    install_recorder_if_asked()?;
    let targets = Targets::start().await?;
    let (calls, ways) = (&plan.calls, &plan.ways);
    let mut measured: Vec<Vec<Measured>> = calls
        .iter()
        .map(|_| ways.iter().map(|_| Measured::default()).collect())
        .collect();
    let per_round = plan.iterations.div_ceil(plan.rounds.max(1));
    let secs = plan.throughput_secs / plan.rounds.max(1) as f64;
    for round in 0..plan.rounds.max(1) {
        // Each round starts with another way, so that none always runs
        // first or last.
        let mut order: Vec<usize> = (0..ways.len()).collect();
        let turn = round % order.len().max(1);
        order.rotate_left(turn);
        for (c, &call) in calls.iter().enumerate() {
            for &w in &order {
                let way = ways[w];
                let mut one = targets.callers(way, 1, 1).await?;
                if let Some(caller) = one.first_mut() {
                    latency(caller, call, per_round, &mut measured[c][w].latency_us).await?;
                }
                if secs > 0.0 {
                    let many = targets
                        .callers(way, plan.concurrency, plan.connections)
                        .await?;
                    let rate = throughput(many, call, secs).await?;
                    measured[c][w].rates.push(rate);
                }
            }
        }
    }
    let mut rows = Vec::new();
    for (c, &call) in calls.iter().enumerate() {
        let summary: Vec<Value> = ways
            .iter()
            .enumerate()
            .map(|(w, &way)| summarize(call, way, &mut measured[c][w]))
            .collect();
        let of = |way: Way, key: &str| {
            let w = ways.iter().position(|&x| x == way)?;
            summary[w][key].as_f64().filter(|&v| v > 0.0)
        };
        for row in &summary {
            let mut row = row.clone();
            let ratio = |key: &str, base: Way| match (row[key].as_f64(), of(base, key)) {
                (Some(mine), Some(base)) => json!(mine / base),
                _ => Value::Null,
            };
            let ratios = json!({
                "p50_vs_grpc_tuned": ratio("p50_us", Way::GrpcTuned),
                "p99_vs_grpc_tuned": ratio("p99_us", Way::GrpcTuned),
                "throughput_vs_grpc_tuned": ratio("calls_per_s", Way::GrpcTuned),
                "p50_vs_grpc": ratio("p50_us", Way::Grpc),
                "p99_vs_grpc": ratio("p99_us", Way::Grpc),
                "throughput_vs_grpc": ratio("calls_per_s", Way::Grpc),
                "p50_vs_floor": ratio("p50_us", Way::Floor),
                "throughput_vs_floor": ratio("calls_per_s", Way::Floor),
            });
            if let (Some(row), Some(ratios)) = (row.as_object_mut(), ratios.as_object()) {
                row.extend(ratios.clone());
            }
            rows.push(row);
        }
    }
    let table = markdown(plan, meta, &rows);
    drop(targets);
    Ok((rows, table))
}

fn summarize(call: Call, way: Way, measured: &mut Measured) -> Value {
    measured.latency_us.sort_by(f64::total_cmp);
    let l = &measured.latency_us;
    let mean = l.iter().sum::<f64>() / l.len().max(1) as f64;
    let mut rates = measured.rates.clone();
    rates.sort_by(f64::total_cmp);
    json!({
        "bench": "rpc",
        "call": call.label(),
        "way": way.label(),
        "calls_measured": l.len(),
        "p50_us": quantile(l, 0.5),
        "p99_us": quantile(l, 0.99),
        "p999_us": quantile(l, 0.999),
        "mean_us": mean,
        // No throughput run (`--throughput-secs 0`): no figure.
        "calls_per_s": (!rates.is_empty()).then(|| quantile(&rates, 0.5)),
        "calls_per_s_min": rates.first().copied(),
        "calls_per_s_max": rates.last().copied(),
    })
}

/// The table, with the targets checked.
pub fn markdown(plan: &Plan, meta: &Meta, rows: &[Value]) -> String {
    let mut out = format!(
        "## rpc: Fetch of {FETCH_KEYS} keys x dim {DIM} and an empty Health, client and server in separate processes\n\n{}\n\nLatency: {} calls per way and call, one outstanding; throughput: {} callers for {:.1} s per way and call (median of {} interleaved rounds); Tessera's callers share one channel of {} connections, tuned tonic's the same number of connections, tonic with defaults one, the floor's have one each. The like-for-like comparison is with tuned tonic; the one with tonic's defaults is what an untuned client gets.\n\n",
        meta.machine_line(),
        plan.iterations,
        plan.concurrency,
        plan.throughput_secs,
        plan.rounds,
        plan.connections
    );
    out.push_str("| call | way | p50 µs | p99 µs | p999 µs | mean µs | calls/s | p50 vs tuned grpc | throughput vs tuned grpc | p50 vs grpc defaults | throughput vs grpc defaults | p50 vs floor | throughput vs floor |\n");
    out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let f = |row: &Value, key: &str| row[key].as_f64().unwrap_or(0.0);
    let x = |row: &Value, key: &str| {
        row[key]
            .as_f64()
            .map_or("-".to_owned(), |v| format!("{v:.2}"))
    };
    for row in rows {
        out.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} |\n",
            row["call"].as_str().unwrap_or(""),
            row["way"].as_str().unwrap_or(""),
            f(row, "p50_us"),
            f(row, "p99_us"),
            f(row, "p999_us"),
            f(row, "mean_us"),
            f(row, "calls_per_s"),
            x(row, "p50_vs_grpc_tuned"),
            x(row, "throughput_vs_grpc_tuned"),
            x(row, "p50_vs_grpc"),
            x(row, "throughput_vs_grpc"),
            x(row, "p50_vs_floor"),
            x(row, "throughput_vs_floor"),
        ));
    }
    let find = |call: &str, way: Way| {
        rows.iter()
            .find(|r| r["call"] == call && r["way"] == way.label())
            .cloned()
            .unwrap_or(Value::Null)
    };
    let tcp_fetch = find("fetch", Way::TesseraTcp);
    let tcp_health = find("health", Way::TesseraTcp);
    let rdma_fetch = find("fetch", Way::TesseraRdma);
    let grpc_fetch = find("fetch", Way::GrpcTuned);
    let grpc_tail = match (grpc_fetch["p99_us"].as_f64(), grpc_fetch["p50_us"].as_f64()) {
        (Some(p99), Some(p50)) if p50 > 0.0 => Some(p99 / p50),
        _ => None,
    };
    // (target, measured, met when), each only where both ways were measured.
    type Check = (&'static str, Option<f64>, fn(f64) -> bool);
    let checks: [Check; 8] = [
        (
            "Tessera over TCP, Fetch throughput >= 2x tuned tonic's (like for like)",
            tcp_fetch["throughput_vs_grpc_tuned"].as_f64(),
            |v| v >= 2.0,
        ),
        (
            "Tessera over TCP, Fetch throughput >= 4x tonic's with its defaults",
            tcp_fetch["throughput_vs_grpc"].as_f64(),
            |v| v >= 4.0,
        ),
        (
            "Tessera over TCP, Fetch throughput >= 0.6x the floor's",
            tcp_fetch["throughput_vs_floor"].as_f64(),
            |v| v >= 0.6,
        ),
        (
            "Tessera over TCP, Fetch p50 <= 1.6x the floor's",
            tcp_fetch["p50_vs_floor"].as_f64(),
            |v| v <= 1.6,
        ),
        (
            "Tessera over TCP, Fetch p50 <= 0.5x tuned tonic's (like for like)",
            tcp_fetch["p50_vs_grpc_tuned"].as_f64(),
            |v| v <= 0.5,
        ),
        (
            "Tessera over TCP, Health p50 <= 1.25x the floor's",
            tcp_health["p50_vs_floor"].as_f64(),
            |v| v <= 1.25,
        ),
        (
            "rdma-soft Fetch p50 no further from the floor than TCP's (ratio of ratios <= 1)",
            rdma_fetch["p50_vs_floor"]
                .as_f64()
                .zip(tcp_fetch["p50_vs_floor"].as_f64())
                .filter(|(_, tcp)| *tcp > 0.0)
                .map(|(rdma, tcp)| rdma / tcp),
            |v| v <= 1.0,
        ),
        (
            "gRPC endpoint (tuned client), Fetch p99 <= 3x its p50 (no Nagle stalls)",
            grpc_tail,
            |v| v <= 3.0,
        ),
    ];
    out.push_str("\n| target | measured | |\n|---|---:|---|\n");
    for (what, value, ok) in checks {
        if let Some(value) = value {
            let met = if ok(value) { "met" } else { "missed" };
            out.push_str(&format!("| {what} | {value:.2} | {met} |\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ways_and_calls_parse_by_their_short_names() {
        for way in Way::ALL {
            let short = way.label().split(' ').next().unwrap_or("");
            assert_eq!(short.parse::<Way>(), Ok(way));
        }
        assert!("tonic".parse::<Way>().is_err());
        assert_eq!("health".parse::<Call>(), Ok(Call::Health));
        assert!("push".parse::<Call>().is_err());
    }

    #[test]
    fn a_target_whose_baseline_was_not_measured_is_left_out() {
        let meta = Meta::collect("rpc");
        let plan = Plan {
            ways: vec![Way::Floor, Way::TesseraTcp],
            calls: vec![Call::Health],
            ..Plan::new(true)
        };
        let rows = vec![
            json!({"call": "health", "way": Way::Floor.label(), "p50_us": 20.0, "p50_vs_floor": 1.0}),
            json!({"call": "health", "way": Way::TesseraTcp.label(), "p50_us": 30.0, "p50_vs_floor": 1.5, "p50_vs_grpc": null}),
        ];
        let table = markdown(&plan, &meta, &rows);
        assert!(
            table.contains("Health p50 <= 1.25x the floor's | 1.50 | missed"),
            "{table}"
        );
        assert!(!table.contains("tonic's (like for like)"), "{table}");
        assert!(!table.contains("tonic's with its defaults"), "{table}");
        assert!(!table.contains("no Nagle"), "{table}");
    }
}
