//! The Tessera parameter server: hosts shards of embedding tables and
//! serves `Fetch`, `Push` and `Health`, and `Admin` (checkpoints,
//! statistics) — see `proto/ps.proto` — over Tessera RPC and, optionally,
//! gRPC.
//!
//! `ps-server` is the binary most users run (`ps-server --config FILE`);
//! the library starts the same server inside a program or a test:
//!
//! ```
//! use tessera_ps_server::{PsServer, PsServerConfig, TableConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = PsServer::bind(&PsServerConfig {
//!     listen: "127.0.0.1:0".into(),
//!     tables: vec![TableConfig::new("emb", 8)],
//!     ..PsServerConfig::default()
//! })
//! .await?;
//! assert_ne!(server.local_addr().port(), 0);
//! // The rows themselves live in the shard engine (`tessera-store`).
//! assert_eq!(server.store().table("emb").map(|t| t.rows()), Some(0));
//! // Serves until the future given resolves (a signal, in a binary:
//! // `tessera_rpc::shutdown_signal()`), then drains its connections.
//! let stopped = server.serve(async {}).await;
//! # drop(stopped);
//! # Ok(())
//! # }
//! ```

mod admin;
pub mod config;
pub mod coordination;
pub mod delta;
#[cfg(test)]
mod dst;
pub mod fence;
pub mod grpc_health;
mod grpc_limits;
pub mod replication;
pub mod reshard;
mod service;
mod sweeper;
pub mod wire;

// The shard engine (`tessera-store`), re-exported for this crate's users
// under the paths it had when it was part of this crate. The modules here
// import it as `tessera_store::...`.
pub use tessera_store::{checkpoint, dedup, image, rowfile, rows, store, table, version};

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tessera_proto::v1::admin_server::AdminServer as AdminGrpcServer;
use tessera_proto::v1::parameter_server_server::ParameterServerServer as GrpcServer;
use tessera_proto::v1::{
    AdminGrpc, AdminServer, DeltaServer, ParameterServerGrpc, ParameterServerServer,
    ReplicationServer,
};
use tessera_rpc::{Server, ServerError, Transport, Validate};
use tokio_util::task::AbortOnDropHandle;

pub use admin::{AdminService, Checkpointer};
pub use checkpoint::{CheckpointError, Corruption, Difference, Missing};
pub use coordination::Coordination;
pub use replication::{Replication, ReplicationService};
pub use version::Version;

pub use config::{ConfigError, Mode, PsServerConfig, StoreConfig, TableConfig};
pub use service::PsService;
pub use store::{PushId, PushOutcome, Store, StoreError};

/// A parameter server bound to its address, ready to serve.
#[derive(Debug)]
pub struct PsServer {
    server: Server,
    store: Arc<Store>,
    /// The optional gRPC endpoint: its listener and the bridge to serve.
    grpc: Option<GrpcEndpoint>,
    /// Checkpoints, with their period (zero: on demand only).
    checkpoints: Option<(Arc<Checkpointer>, std::time::Duration)>,
    replication: Arc<Replication>,
    coordination: Coordination,
    shutdown_grace: std::time::Duration,
    /// A training server's delta stream (`[delta]`, or etcd mode: a
    /// resize's giving side).
    sender: Option<Arc<delta::Sender>>,
    /// A serving server's feed (`mode = "serving"`), or a training
    /// server's for resizes (etcd mode: the receiving side).
    feed: Option<Arc<delta::Feed>>,
    /// Its part in resizes of the cluster (etcd mode, training).
    resharding: Option<reshard::Resharding>,
}

struct GrpcEndpoint {
    listener: tokio::net::TcpListener,
    limits: grpc_limits::GrpcLimits,
    inbound: tessera_rpc::InboundConfig,
    service: GrpcServer<ParameterServerGrpc<PsService>>,
    admin: tonic::service::interceptor::InterceptedService<
        AdminGrpcServer<AdminGrpc<AdminService>>,
        grpc_limits::RoleCheck,
    >,
    /// TLS on the endpoint (ALPN `h2`), when `[tls]` is on.
    tls: Option<tessera_rpc::tls::TlsAcceptor>,
}

impl std::fmt::Debug for GrpcEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcEndpoint")
            .field("addr", &self.listener.local_addr().ok())
            .finish_non_exhaustive()
    }
}

/// Restores the newest checkpoint of `checkpoint.dir` into `store`,
/// verified whole before anything is installed (the server does not
/// listen until it is).
fn restore_checkpoint(store: &Store, config: &PsServerConfig) -> Result<(), PsError> {
    if let Some(dir) = &config.checkpoint.dir
        && config.checkpoint.restore
    {
        let started = std::time::Instant::now();
        // A training server in etcd mode may load a checkpoint saved
        // under a finished resize's count (or the one before it); the
        // shard map must name that count (checked once it is read).
        let other_counts = config.takes_part_in_resizes();
        match checkpoint::load_latest(store, dir, other_counts)? {
            Some(loaded) => {
                let path = loaded.path.clone();
                store.install(loaded);
                tracing::info!(path = %path.display(), took = ?started.elapsed(), "checkpoint restored");
            }
            None => tracing::info!(dir = %dir.display(), "no checkpoint to restore"),
        }
    }
    Ok(())
}

/// A training server started during a resize: its receiving shards and
/// the fence of moved keys, before it serves anything; and a checkpoint of
/// another count than the configured one only where the map's last resize
/// reconciles it (`crate::reshard`).
fn prepare_for_resizes(
    store: &Store,
    config: &PsServerConfig,
    coordination: &Coordination,
) -> Result<(), PsError> {
    if config.mode == Mode::Training {
        let map = coordination.shard_map().borrow().clone();
        // A checkpoint of another count than the configured one: only
        // one the map's last resize reconciles (`crate::reshard`).
        if store.num_shards() != config.num_shards
            && !reshard::reconciles(map.as_ref(), store.num_shards())
        {
            return Err(PsError::CheckpointCount {
                saved: store.num_shards(),
                configured: config.num_shards,
                map: map.map(|m| m.num_shards),
            });
        }
        reshard::prepare(store, map.as_ref());
    }
    Ok(())
}

/// The two ends of the delta stream a server has: the sender (a training
/// server with `[delta]`, or one in etcd mode, which may give keys to a
/// resize) and the feed (a serving server's, or a training server's in
/// etcd mode, which may take keys in one).
fn delta_ends(
    config: &PsServerConfig,
    store: &Arc<Store>,
    replication: &Arc<Replication>,
    transport: &Transport,
) -> (Option<Arc<delta::Sender>>, Option<Arc<delta::Feed>>) {
    let resizes = config.takes_part_in_resizes();
    let sender =
        (config.mode == Mode::Training && (config.delta.enabled() || resizes)).then(|| {
            delta::Sender::new(
                Arc::clone(store),
                Arc::clone(replication),
                &config.delta,
                config.advertised().to_owned(),
                transport,
            )
        });
    let feed = match config.mode {
        Mode::Serving => Some(delta::Feed::new(
            Arc::clone(store),
            config.serving.max_delay_ms,
            transport,
        )),
        _ if resizes => Some(delta::Feed::for_resizes(Arc::clone(store), transport)),
        _ => None,
    };
    if let Some(feed) = feed.as_ref().filter(|_| config.mode != Mode::Serving) {
        let replication = Arc::clone(replication);
        feed.check_leads(delta::LeadCheck::new(move |shard| {
            replication
                .leading_epoch(shard, std::time::Instant::now())
                .is_some()
        }));
    }
    (sender, feed)
}

/// The gRPC endpoint at `addr`: the same services over HTTP/2.
async fn bind_grpc(
    addr: &str,
    config: &PsServerConfig,
    service: &PsService,
    admin: &AdminService,
    transport: &Transport,
) -> Result<GrpcEndpoint, PsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| PsError::GrpcBind {
            addr: addr.to_owned(),
            source,
        })?;
    tracing::info!(addr = ?listener.local_addr().ok(), "gRPC endpoint listening");
    let max_message = usize::try_from(config.max_message_size).unwrap_or(usize::MAX);
    Ok(GrpcEndpoint {
        listener,
        limits: grpc_limits::GrpcLimits::of(config),
        inbound: config.inbound.clone(),
        tls: transport.tls().map(|tls| tls.h2_acceptor()),
        service: ParameterServerGrpc::service(
            Arc::new(service.clone()),
            transport.send_pool().clone(),
            max_message,
        ),
        admin: tonic::service::interceptor::InterceptedService::new(
            AdminGrpc::service(
                Arc::new(admin.clone()),
                transport.send_pool().clone(),
                max_message,
            ),
            grpc_limits::RoleCheck::new(
                transport.tls_enabled().then(|| config.roles.admin.clone()),
            ),
        ),
    })
}

/// The server's Tessera RPC services. With TLS, who may call is said by
/// certificates: workers Fetch and Push; only operators' tools (admin)
/// take checkpoints, and only the fleet's servers (replication) write to
/// replicas.
fn rpc_services(
    builder: tessera_rpc::ServerBuilder,
    tls: bool,
    config: &PsServerConfig,
    service: PsService,
    admin: AdminService,
    replication: &Arc<Replication>,
    deltas: delta::DeltaService,
) -> Result<tessera_rpc::ServerBuilder, PsError> {
    let mut builder = builder
        .add_service(ParameterServerServer::new(service))?
        .add_service(AdminServer::new(admin))?
        .add_service(ReplicationServer::new(ReplicationService::new(Arc::clone(
            replication,
        ))))?
        .add_service(DeltaServer::new(deltas))?;
    if tls {
        builder = builder
            .require_role(
                tessera_proto::v1::ADMIN_DESCRIPTOR.name,
                &config.roles.admin,
            )?
            .require_role(
                tessera_proto::v1::REPLICATION_DESCRIPTOR.name,
                &config.roles.replication,
            )?
            // Deltas write a serving fleet's rows, and copies read a
            // training shard's: servers of the fleets only.
            .require_role(
                tessera_proto::v1::DELTA_DESCRIPTOR.name,
                &config.roles.replication,
            )?;
    }
    Ok(builder)
}

impl PsServer {
    /// Validates `config`, creates the store and binds the listener.
    pub async fn bind(config: &PsServerConfig) -> Result<Self, PsError> {
        config.validate()?;
        let store = Arc::new(Store::new(&config.store()));
        let checkpoints = config.checkpoint.dir.as_ref().map(|dir| {
            Arc::new(Checkpointer::new(
                Arc::clone(&store),
                dir.clone(),
                config.checkpoint.keep,
            ))
        });
        restore_checkpoint(&store, config)?;
        let server_config = config.server_config();
        // Built here rather than by the server so that the gRPC endpoint
        // builds its responses in the same send pool, and replication
        // reaches the peers over it.
        let transport =
            Transport::new(server_config.transport.clone()).map_err(PsError::Transport)?;
        let fence = coordination::fence_for(config);
        let replication =
            Replication::new(Arc::clone(&store), config, &transport, Arc::clone(&fence));
        let coordination = Coordination::prepare(config, &replication, fence).await?;
        prepare_for_resizes(&store, config, &coordination)?;
        let (sender, feed) = delta_ends(config, &store, &replication, &transport);
        let resharding = coordination
            .etcd()
            .filter(|_| config.takes_part_in_resizes())
            .map(|coord| {
                reshard::Resharding::new(
                    config.advertised().to_owned(),
                    coord,
                    coordination.shard_map(),
                    Arc::clone(&store),
                    Arc::clone(&replication),
                    sender.clone(),
                    feed.clone(),
                    std::time::Duration::from_millis(config.delta.interval_ms),
                )
            });
        let service = PsService::new(
            Arc::clone(&store),
            config.replica_group,
            Arc::clone(&replication),
            match config.coordinator.kind {
                config::CoordinatorKind::Static => "static",
                config::CoordinatorKind::Etcd => "etcd",
            },
            config.transport.as_str(),
            checkpoints.clone(),
        )
        .with_delta(feed.clone(), sender.clone())
        .with_shard_map(coordination.shard_map());
        let admin = AdminService::new(Arc::clone(&store), checkpoints.clone());
        let grpc = match &config.grpc_listen {
            None => None,
            Some(addr) => Some(bind_grpc(addr, config, &service, &admin, &transport).await?),
        };
        let tls = transport.tls_enabled();
        let builder = rpc_services(
            Server::builder(server_config).transport(transport),
            tls,
            config,
            service,
            admin,
            &replication,
            delta::DeltaService::new(Arc::clone(&store), feed.clone(), sender.clone()),
        )?;
        let server = builder.bind(&config.listen).await?;
        tracing::info!(
            addr = %server.local_addr(),
            shards = ?config.shards,
            num_shards = config.num_shards,
            replica_group = config.replica_group,
            mode = ?config.mode,
            coordinator = ?config.coordinator.kind,
            "ps-server listening"
        );
        Ok(Self {
            server,
            store,
            grpc,
            replication,
            coordination,
            shutdown_grace: std::time::Duration::from_millis(config.shutdown_grace_ms),
            sender,
            feed,
            resharding,
            checkpoints: checkpoints.map(|c| {
                (
                    c,
                    std::time::Duration::from_secs(config.checkpoint.interval_secs),
                )
            }),
        })
    }

    /// The bound address of the gRPC endpoint, if it has one.
    pub fn grpc_addr(&self) -> Option<SocketAddr> {
        self.grpc
            .as_ref()
            .and_then(|grpc| grpc.listener.local_addr().ok())
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The rows this server holds.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Its replication state (primary streams, replica shards).
    pub fn replication(&self) -> &Arc<Replication> {
        &self.replication
    }

    /// Serves until `shutdown` completes, then shuts down gracefully: with
    /// a coordinator, the shards it leads are handed over first; then
    /// in-flight requests finish and their answers leave (the gRPC
    /// endpoint's too). Returns the rows, which are freed when it is
    /// dropped (see [`Stopped`]).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Stopped {
        let stopped = Stopped {
            store: Arc::clone(&self.store),
        };
        let Self {
            server,
            grpc,
            replication,
            mut coordination,
            checkpoints,
            shutdown_grace,
            sender,
            feed,
            resharding,
            ..
        } = self;
        replication.start();
        coordination.start(&replication);
        // The standard health protocol on the gRPC endpoint: NOT_SERVING
        // until every hosted shard is served, and again from the moment
        // shutdown begins (before the shards are handed over), so probes
        // and load balancers stop sending traffic first.
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let reporting = match &grpc {
            None => None,
            Some(_) => {
                grpc_health::report(&reporter, grpc_health::status_of(&replication)).await;
                Some(AbortOnDropHandle::new(tokio::spawn(
                    grpc_health::keep_reporting(reporter.clone(), Arc::clone(&replication)),
                )))
            }
        };
        let ending = reporter.clone();
        let shutdown = async move {
            shutdown.await;
            if let Some(reporting) = reporting {
                // Stopped for certain before NOT_SERVING is set (an abort
                // alone leaves a poll running on another thread free to
                // set SERVING after it).
                reporting.abort();
                let _ = reporting.await;
                grpc_health::report(&reporter, tonic_health::ServingStatus::NotServing).await;
            }
            coordination.shutdown(shutdown_grace).await;
        };
        let _stop_replication = StopOnDrop(Arc::clone(&replication));
        let _store_gauges = AbortOnDropHandle::new(tokio::spawn(publish_store_gauges(Arc::clone(
            &stopped.store,
        ))));
        let stop_delta = tokio_util::sync::CancellationToken::new();
        let _stop_delta = stop_delta.clone().drop_guard();
        let _sender_shutdown = sender.clone().map(SenderOnDrop);
        let _delta = sender
            .map(|sender| AbortOnDropHandle::new(tokio::spawn(sender.run(stop_delta.clone()))));
        let _resharding = resharding.map(|resharding| {
            AbortOnDropHandle::new(tokio::spawn(resharding.run(stop_delta.clone())))
        });
        let _stop_feed = feed.map(FeedOnDrop);
        let _sweeper = AbortOnDropHandle::new(tokio::spawn(sweeper::run(
            Arc::clone(&stopped.store),
            Arc::clone(&replication),
        )));
        let _periodic = checkpoints.as_ref().and_then(|(checkpoints, every)| {
            (!every.is_zero()).then(|| {
                AbortOnDropHandle::new(tokio::spawn(periodic_checkpoints(
                    Arc::clone(checkpoints),
                    *every,
                )))
            })
        });
        let Some(grpc) = grpc else {
            server.serve_with_shutdown(shutdown).await;
            final_checkpoint(checkpoints.as_ref().map(|(c, _)| c), &replication).await;
            return stopped;
        };
        let (stop_grpc, grpc_stopped) = tokio::sync::oneshot::channel::<()>();
        let grpc_task = tokio::spawn(async move {
            let served = grpc
                .limits
                .builder()
                .add_service(grpc.service)
                .add_service(grpc.admin)
                .add_service(health_service)
                .serve_with_incoming_shutdown(
                    grpc_limits::incoming(grpc.listener, &grpc.inbound, grpc.tls),
                    async {
                        let _ = grpc_stopped.await;
                    },
                )
                .await;
            if let Err(err) = served {
                tracing::error!(%err, "gRPC endpoint failed");
            }
        });
        server
            .serve_with_shutdown(async move {
                shutdown.await;
                // A health Watch is an RPC in flight until it ends: end
                // them (their last message is the NOT_SERVING above), or
                // the endpoint's graceful stop would wait for them forever.
                grpc_health::end_watches(ending).await;
                let _ = stop_grpc.send(());
            })
            .await;
        let _ = grpc_task.await;
        final_checkpoint(checkpoints.as_ref().map(|(c, _)| c), &replication).await;
        stopped
    }
}

/// What a stopped [`PsServer`] leaves: its rows. Dropping it frees them,
/// one allocation per row; [`Stopped::leak`] leaves them to the kernel.
#[derive(Debug)]
pub struct Stopped {
    store: Arc<Store>,
}

impl Stopped {
    /// The rows as the server left them.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Ends without freeing the rows: for a process about to exit, whose
    /// memory the kernel takes back at once. Freeing them one by one took
    /// a stopping server a second of CPU with a few million rows, on a
    /// host whose other servers then answered 2-5x slower for that second
    /// (a rolling restart's slowest requests over RDMA, issue 33).
    pub fn leak(self) {
        std::mem::forget(self.store);
    }
}

/// A last checkpoint once the server has stopped taking calls (every
/// acknowledged Push is in it), so that a restart, even of every copy of a
/// shard at once, restores all of it rather than the last periodic
/// checkpoint's state, minutes older. Skipped, and said, while a hosted
/// shard has no complete copy here (it would record a partial one over a
/// good older checkpoint).
async fn final_checkpoint(checkpoints: Option<&Arc<Checkpointer>>, replication: &Replication) {
    let Some(checkpoints) = checkpoints else {
        return;
    };
    if !replication.caught_up() {
        tracing::warn!("no checkpoint at shutdown: a hosted shard has no complete copy here");
        return;
    }
    match checkpoints.save().await {
        Ok(info) => {
            tracing::info!(rows = info.rows, path = %info.path.display(), "checkpoint at shutdown")
        }
        Err(err) => tracing::warn!(%err, "checkpoint at shutdown failed"),
    }
}

/// Stops a serving server's copy tasks when it stops serving.
struct FeedOnDrop(Arc<delta::Feed>);

impl Drop for FeedOnDrop {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

/// Lets a training server's delta sender go of its transport when the
/// server stops serving (its task may be aborted before its own end).
struct SenderOnDrop(Arc<delta::Sender>);

impl Drop for SenderOnDrop {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

/// Stops replication's background tasks when the server stops serving.
struct StopOnDrop(Arc<Replication>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

/// Seconds between two publications of the store's gauges (rows and
/// memory per table and shard): each takes every stripe's read lock for a
/// moment.
const STORE_GAUGES_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

async fn publish_store_gauges(store: Arc<Store>) {
    let mut ticks = tokio::time::interval(STORE_GAUGES_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        for table in store.tables() {
            table.publish_gauges();
        }
    }
}

async fn periodic_checkpoints(checkpoints: Arc<Checkpointer>, every: std::time::Duration) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        // A failure is counted, logged and shown in Health by the save;
        // the next tick retries.
        let _ = checkpoints.save().await;
    }
}

/// Why a parameter server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PsError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The RPC server could not be set up.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// The transport could not be created (for example no RDMA device).
    #[error("transport: {0}")]
    Transport(#[source] tessera_rpc::TransportError),
    /// The checkpoint to restore is partial, corrupt or does not fit.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The coordinator could not be set up.
    #[error(transparent)]
    Coordinator(#[from] tessera_coord::CoordError),
    /// The checkpoint restored was saved under a shard count the
    /// cluster's shard map does not reconcile with the configured one.
    #[error(
        "the checkpoint restored was saved with num_shards = {saved} and this server is configured with {configured}; the cluster's shard map ({map:?} shards) names neither in its last resize: move the checkpoint away, or configure {saved}"
    )]
    CheckpointCount {
        /// The checkpoint's count.
        saved: u32,
        /// The configured count.
        configured: u32,
        /// The map's count, if it was read.
        map: Option<u32>,
    },
    /// The gRPC endpoint could not listen.
    #[error("grpc_listen = {addr}: {source}")]
    GrpcBind {
        /// The configured `grpc_listen`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}
