//! A ps-server in this process.

use std::sync::Arc;

use tessera_proto::v1::{AdminClient, ParameterServerClient, ReplicationClient};
use tessera_ps_server::{PsError, PsServer, PsServerConfig, Replication, Store};
use tessera_rpc::Channel;
use tokio::sync::oneshot;

/// A server serving on a task of the test's runtime.
pub struct InProcess {
    /// Its bound address.
    pub addr: String,
    /// Its gRPC endpoint's address, when it has one (`grpc_listen`).
    pub grpc_addr: Option<std::net::SocketAddr>,
    /// Its rows.
    pub store: Arc<Store>,
    /// Its replication.
    pub replication: Arc<Replication>,
    /// A client of its data service.
    pub data: ParameterServerClient,
    /// A client of its admin service.
    pub admin: AdminClient,
    /// A client of its replication service.
    pub peer: ReplicationClient,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl InProcess {
    /// Binds `config` and serves it.
    pub async fn start(config: &PsServerConfig) -> Self {
        Self::try_start(config).await.unwrap()
    }

    /// Binds `config` and serves it, or says why it could not.
    pub async fn try_start(config: &PsServerConfig) -> Result<Self, PsError> {
        let server = PsServer::bind(config).await?;
        let addr = server.local_addr().to_string();
        let grpc_addr = server.grpc_addr();
        let store = Arc::clone(server.store());
        let replication = Arc::clone(server.replication());
        // Its clients present the server's own certificate where it has
        // one (TLS), so they hold whatever roles the server holds.
        let mut channel_config = crate::health::patient();
        channel_config.transport.tls = config.tls.clone();
        let channel = Channel::lazy(addr.clone(), channel_config).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            // The rows are freed when the test's process ends or its store
            // handle goes (dropped here).
            drop(
                server
                    .serve(async {
                        let _ = stopped.await;
                    })
                    .await,
            );
        });
        Ok(Self {
            addr,
            grpc_addr,
            store,
            replication,
            data: ParameterServerClient::new(channel.clone()),
            admin: AdminClient::new(channel.clone()),
            peer: ReplicationClient::new(channel),
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stops it the way a crash would as far as its peers and the
    /// coordinator can tell: no shutdown, no handover; its tasks are
    /// aborted (it stops renewing its lease; connections it had open may
    /// linger until they are used).
    pub fn crash(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    /// Shuts it down gracefully and waits until it has.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
