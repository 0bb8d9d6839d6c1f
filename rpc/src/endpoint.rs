//! Where a generated client sends its calls: one server or a replica set.

use tessera_transport::Message;
use tessera_transport::pool::Pool;

use crate::{CallOptions, Channel, MethodDescriptor, ReplicaSet, RpcError};

/// The target of a generated client: a [`Channel`] to one server, or a
/// [`ReplicaSet`] that picks a replica per call and applies the recovery
/// policies. Cheap to clone.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// One server; a failed call is returned as it failed.
    Channel(Channel),
    /// Replicas of one service; calls are retried and failed over.
    Replicas(ReplicaSet),
}

impl From<Channel> for Endpoint {
    fn from(channel: Channel) -> Self {
        Endpoint::Channel(channel)
    }
}

impl From<ReplicaSet> for Endpoint {
    fn from(set: ReplicaSet) -> Self {
        Endpoint::Replicas(set)
    }
}

impl Endpoint {
    /// The send pool requests are encoded into.
    pub fn send_pool(&self) -> &Pool {
        match self {
            Endpoint::Channel(channel) => channel.send_pool(),
            Endpoint::Replicas(set) => set.send_pool(),
        }
    }

    /// A description for logs and errors: the server's address, or the
    /// replicas' addresses joined by commas.
    pub fn describe(&self) -> String {
        match self {
            Endpoint::Channel(channel) => channel.addr().to_owned(),
            Endpoint::Replicas(set) => set.addrs().join(","),
        }
    }

    /// Calls `method` with an encoded request body and decodes the answer.
    pub async fn unary_message<Resp>(
        &self,
        method: &'static MethodDescriptor,
        body: Message,
        options: &CallOptions,
    ) -> Result<Resp, RpcError>
    where
        Resp: prost::Message + Default,
    {
        match self {
            Endpoint::Channel(channel) => channel.unary_message(method, body, options).await,
            Endpoint::Replicas(set) => set.unary_message(method, body, options).await,
        }
    }
}
