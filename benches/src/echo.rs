//! The echo service of the `recovery` benchmark (`proto/bench.proto`):
//! every call answered with its request.

use tessera_rpc::{RequestContext, Status};

/// Messages and stubs generated from `bench.proto`.
#[allow(missing_docs, dead_code, clippy::all)]
pub mod generated {
    include!(concat!(env!("OUT_DIR"), "/tessera.bench.v1.rs"));
}

pub use generated::{Bench, BenchClient, BenchServer, Payload};

/// Answers every call with its request.
#[derive(Debug, Clone, Copy)]
pub struct EchoService;

impl Bench for EchoService {
    async fn echo(&self, _context: RequestContext, request: Payload) -> Result<Payload, Status> {
        Ok(request)
    }
}
