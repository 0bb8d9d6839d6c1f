//! The Tessera parameter server: hosts shards of embedding tables and
//! serves `Fetch`, `Push` and `Health` (see `proto/ps.proto`) over Tessera
//! RPC.

pub mod config;
mod service;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tessera_proto::v1::ParameterServerServer;
use tessera_rpc::{Server, ServerError, Validate};

pub use config::{ConfigError, Mode, PsServerConfig, TableConfig};
pub use service::PsService;
pub use store::{Store, StoreError};

/// A parameter server bound to its address, ready to serve.
#[derive(Debug)]
pub struct PsServer {
    server: Server,
    store: Arc<Store>,
}

impl PsServer {
    /// Validates `config`, creates the store and binds the listener.
    pub async fn bind(config: &PsServerConfig) -> Result<Self, PsError> {
        config.validate()?;
        let store = Arc::new(Store::new(config));
        let service = PsService::new(Arc::clone(&store), config.replica_group);
        let server = Server::builder(config.server_config())
            .add_service(ParameterServerServer::new(service))?
            .bind(&config.listen)
            .await?;
        tracing::info!(
            addr = %server.local_addr(),
            shards = ?config.shards,
            num_shards = config.num_shards,
            replica_group = config.replica_group,
            mode = ?config.mode,
            "ps-server listening"
        );
        Ok(Self { server, store })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The rows this server holds.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Serves until `shutdown` completes, then shuts down gracefully.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        self.server.serve_with_shutdown(shutdown).await;
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
}
