//! The `Delta` RPC service: deltas in at a serving server (`feed.rs`),
//! copies out at a training server (`source.rs`).

use std::sync::Arc;

use tessera_proto::v1::{self, DeltaCopyRequest, DeltaCopyResponse, DeltaRequest, DeltaResponse};
use tessera_rpc::{RequestContext, Status};

use super::{Feed, Sender, Sources};
use tessera_store::store::Store;

/// The `Delta` service of a server.
#[derive(Debug, Clone)]
pub struct DeltaService {
    store: Arc<Store>,
    feed: Option<Arc<Feed>>,
    sender: Option<Arc<Sender>>,
    sources: Arc<Sources>,
}

impl DeltaService {
    /// The service of a server over `store`: a serving server has a
    /// `feed`; a training server with `[delta]` a `sender`.
    pub fn new(store: Arc<Store>, feed: Option<Arc<Feed>>, sender: Option<Arc<Sender>>) -> Self {
        Self {
            store,
            feed,
            sender,
            sources: Arc::new(Sources::default()),
        }
    }
}

impl v1::Delta for DeltaService {
    async fn apply(
        &self,
        _context: RequestContext,
        request: DeltaRequest,
    ) -> Result<DeltaResponse, Status> {
        let Some(feed) = &self.feed else {
            return Err(Status::failed_precondition(
                "this server is not a serving server (mode = serving): it takes no deltas",
            ));
        };
        feed.apply(request).await
    }

    async fn copy(
        &self,
        _context: RequestContext,
        request: DeltaCopyRequest,
    ) -> Result<DeltaCopyResponse, Status> {
        let (store, sender, sources) = (
            Arc::clone(&self.store),
            self.sender.clone(),
            Arc::clone(&self.sources),
        );
        // A snapshot under the shard's lock, then megabytes of rows to
        // read: off the async threads.
        tokio::task::spawn_blocking(move || sources.page(&store, sender.as_deref(), &request))
            .await
            .map_err(|err| Status::internal(format!("reading a copy page failed: {err}")))?
    }
}
