//! Set-up shared by the RPC layer's end-to-end tests: the services
//! generated from `tests/proto/echo.proto` with handlers whose latency and
//! failures a test controls, servers started on loopback, channel and
//! replica-set configurations, and the macro that runs a case over TCP and
//! over RDMA with the soft provider.
#![allow(dead_code, unused_imports, unused_macros)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tessera_rpc::policy::{QuarantineConfig, RetryPolicyConfig};
use tessera_rpc::{
    ChannelConfig, Code, ReplicaEndpoint, ReplicaSetConfig, RequestContext, Server, ServerConfig,
    Status, TransportConfig,
};
use tessera_transport::pool::lookup;
use tokio::sync::oneshot;

/// Every case runs over TCP and over RDMA (over the provider the suite runs
/// on: `tessera_test_support::rdma`).
macro_rules! over_both_transports {
    ($($case:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::TransportConfig::default()).await;
                }
            )*
        }
        mod rdma {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(tessera_test_support::rdma::transport()).await;
                }
            )*
        }
    };
}

#[allow(clippy::all, missing_docs, dead_code)]
pub mod generated {
    include!(concat!(env!("OUT_DIR"), "/tessera.test.v1.rs"));
}
pub use generated::*;

#[derive(Default, Clone)]
pub struct EchoImpl {
    /// Echo calls this server's handler has begun.
    pub started: std::sync::Arc<AtomicU64>,
    /// The peer address of every Echo call (one per client connection).
    pub peers: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<std::net::SocketAddr>>>,
    /// Echo handlers dropped before they finished (the server gave the
    /// call up: its deadline passed, or the server stopped).
    pub abandoned: std::sync::Arc<AtomicU64>,
}

/// Counts a handler dropped before it finished (see
/// [`EchoImpl::abandoned`]); disarmed when it finishes.
struct Unfinished(Option<std::sync::Arc<AtomicU64>>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(abandoned) = self.0.take() {
            abandoned.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Echo calls whose delay of exactly `SLOW_MARKER_MS` ran to completion.
pub static SLOW_MARKER_COMPLETED: AtomicU64 = AtomicU64::new(0);
pub const SLOW_MARKER_MS: u32 = 777;
/// Pool id of the memory the last payload of 3s was decoded from.
pub static LAST_REQUEST_PAYLOAD_POOL: AtomicU64 = AtomicU64::new(0);

impl Echo for EchoImpl {
    async fn echo(
        &self,
        context: RequestContext,
        request: EchoRequest,
    ) -> Result<EchoResponse, Status> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let mut unfinished = Unfinished(Some(std::sync::Arc::clone(&self.abandoned)));
        self.peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(context.peer);
        if request.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(request.delay_ms))).await;
        }
        // Payloads of 3s come from the zero-copy test only (tests share this
        // process under `cargo test`).
        if request.payload.first() == Some(&3) {
            let pool = lookup(&request.payload[..]).map_or(0, |r| r.pool_id);
            LAST_REQUEST_PAYLOAD_POOL.store(pool, Ordering::SeqCst);
        }
        if request.payload.starts_with(b"panic") {
            panic!("the test asked this handler to panic");
        }
        if request.delay_ms == SLOW_MARKER_MS {
            SLOW_MARKER_COMPLETED.fetch_add(1, Ordering::SeqCst);
        }
        unfinished.0 = None;
        let payload = if request.repeat > 1 {
            Bytes::from(request.payload.repeat(request.repeat as usize))
        } else {
            request.payload
        };
        Ok(EchoResponse {
            payload,
            request_id: context.request_id,
        })
    }

    async fn fail(
        &self,
        _context: RequestContext,
        request: FailRequest,
    ) -> Result<FailResponse, Status> {
        Err(Status::new(
            Code::from_u16(request.code as u16),
            request.message,
        ))
    }
}

#[derive(Default)]
pub struct CounterImpl {
    value: AtomicU64,
}

impl Counter for CounterImpl {
    async fn increment(
        &self,
        _context: RequestContext,
        _request: IncrementRequest,
    ) -> Result<IncrementResponse, Status> {
        Ok(IncrementResponse {
            value: self.value.fetch_add(1, Ordering::SeqCst) + 1,
        })
    }
}

pub struct Running {
    pub addr: String,
    /// Echo calls the server's handler has begun (a signal to wait on).
    pub echo_started: std::sync::Arc<AtomicU64>,
    /// The peer address of every Echo call.
    pub echo_peers:
        std::sync::Arc<std::sync::Mutex<std::collections::HashSet<std::net::SocketAddr>>>,
    /// Echo handlers the server dropped unfinished.
    pub echo_abandoned: std::sync::Arc<AtomicU64>,
    pub stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Waits (at most 10 s) until the server's Echo handler has begun `n`
    /// calls: the signal a test waits on before it acts on "in flight".
    pub async fn wait_echo_started(&self, n: u64) {
        tessera_test_support::wait::eventually(
            Duration::from_secs(10),
            "the server's Echo handler began the calls",
            || async {
                match self.echo_started.load(Ordering::SeqCst) {
                    started if started >= n => Ok(()),
                    started => Err(started),
                }
            },
        )
        .await;
    }

    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.await.unwrap();
    }
}

pub async fn start(config: ServerConfig) -> Running {
    start_at(config, "127.0.0.1:0").await
}

pub async fn start_at(config: ServerConfig, addr: &str) -> Running {
    let echo = EchoImpl::default();
    let server = Server::builder(config)
        .add_service(EchoServer::new(echo.clone()))
        .unwrap()
        .add_service(CounterServer::new(CounterImpl::default()))
        .unwrap()
        .bind(addr)
        .await
        .unwrap();
    let addr = server.local_addr().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(server.serve_with_shutdown(async {
        let _ = stopped.await;
    }));
    Running {
        addr,
        echo_started: echo.started,
        echo_peers: echo.peers,
        echo_abandoned: echo.abandoned,
        stop: Some(stop),
        task,
    }
}

pub fn server_config(transport: &TransportConfig) -> ServerConfig {
    ServerConfig {
        transport: transport.clone(),
        ..ServerConfig::default()
    }
}

/// Timeouts for tests of everything but timeouts: this 2-core host runs
/// many test processes at once, and the paper's 10/40 ms defaults would
/// fail calls on its scheduling delays. Deadline tests set their own.
pub fn channel_config(transport: &TransportConfig) -> ChannelConfig {
    ChannelConfig {
        connect_timeout_ms: 2000,
        request_timeout_ms: 5000,
        transport: transport.clone(),
        ..ChannelConfig::default()
    }
}

/// An address nothing listens on.
pub fn dead_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    drop(listener);
    addr
}

/// An encoded Echo request whose handler waits `delay_ms`.
pub fn echo_body(delay_ms: u32) -> tessera_transport::Message {
    let request = EchoRequest {
        payload: Bytes::from_static(b"hello"),
        delay_ms,
        repeat: 0,
    };
    tessera_transport::Message::from(Bytes::from(prost::Message::encode_to_vec(&request)))
}

/// A replica set over `replicas` with short timeouts, retries always
/// allowed and quarantine after two failed dials.
pub fn replica_config(replicas: Vec<ReplicaEndpoint>) -> ReplicaSetConfig {
    ReplicaSetConfig {
        replicas,
        local_domain: "zone-a".into(),
        channel: ChannelConfig {
            connect_timeout_ms: 200,
            request_timeout_ms: 150,
            ..ChannelConfig::default()
        },
        retry: RetryPolicyConfig {
            probability: 1.0,
            ..RetryPolicyConfig::default()
        },
        quarantine: QuarantineConfig {
            max_connect_failures: 2,
            ..QuarantineConfig::default()
        },
        seed: Some(11),
        ..ReplicaSetConfig::default()
    }
}
