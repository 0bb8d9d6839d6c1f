//! Support for the gRPC endpoints that `tessera-rpc-build` generates with
//! `Builder::grpc(true)`: the generated `FooGrpc<T>` bridges call these to
//! turn a tonic request into a [`RequestContext`] and a Tessera [`Status`]
//! into a gRPC one.
//!
//! tonic (0.14) is the gRPC implementation: the de-facto Rust one, on the
//! same tokio and prost as the rest of Tessera, so the bridge shares the
//! generated message types with the Tessera endpoint instead of converting.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use tessera_transport::PeerIdentity;
pub use tessera_transport::pool::Pool;

use crate::{RequestContext, Status};

/// Ids for gRPC requests (gRPC has none on the wire; handlers log them).
static NEXT_REQUEST_ID: AtomicU64 = AtomicU64::new(1);

/// The context of a gRPC request to `method`: its deadline from the
/// `grpc-timeout` header, the caller's address, and `pool` for responses.
pub fn request_context<T>(
    request: &tonic::Request<T>,
    method: &'static str,
    pool: &Pool,
) -> RequestContext {
    let deadline = request
        .metadata()
        .get("grpc-timeout")
        .and_then(|value| value.to_str().ok())
        .and_then(parse_grpc_timeout)
        .map(|timeout| Instant::now() + timeout - deadline_margin(timeout));
    RequestContext {
        method,
        request_id: NEXT_REQUEST_ID.fetch_add(1, Ordering::Relaxed),
        deadline,
        peer: request
            .remote_addr()
            .or_else(|| peer_info(request).and_then(|info| info.remote_addr))
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
        send_pool: pool.clone(),
        peer_identity: peer_info(request).and_then(|info| info.identity.clone()),
    }
}

/// What a gRPC listener knows of a connection's peer: its address, and
/// who its TLS certificate says it is. A listener whose streams report
/// this as their `tonic::transport::server::Connected::ConnectInfo` makes
/// it reach every request (tonic puts the connect info in each request's
/// extensions), so [`request_context`] and role checks see it.
#[derive(Debug, Clone, Default)]
pub struct GrpcPeerInfo {
    /// The peer's address.
    pub remote_addr: Option<SocketAddr>,
    /// The peer's verified certificate (`None` without TLS).
    pub identity: Option<Arc<PeerIdentity>>,
}

/// The connection's [`GrpcPeerInfo`], if its listener reports one.
pub fn peer_info<T>(request: &tonic::Request<T>) -> Option<&GrpcPeerInfo> {
    request.extensions().get::<GrpcPeerInfo>()
}

/// Refuses (`PERMISSION_DENIED`) a request whose caller's certificate does
/// not give `role`: the gRPC endpoint's version of
/// [`crate::ServerBuilder::require_role`], for a tonic interceptor.
pub fn check_role<T>(request: &tonic::Request<T>, role: &str) -> Result<(), tonic::Status> {
    let identity = peer_info(request).and_then(|info| info.identity.as_ref());
    if identity.is_some_and(|id| id.has_role(role)) {
        return Ok(());
    }
    metrics::counter!(crate::observe::SERVER_REFUSED_ROLE, "method" => "grpc").increment(1);
    Err(tonic::Status::permission_denied(format!(
        "this service needs a certificate with the role `{role}` (urn:tessera:role:{role})"
    )))
}

/// A gRPC status with the same code and message (Tessera's codes are
/// gRPC's), the message cut as the Tessera endpoint cuts it.
pub fn to_grpc_status(status: Status) -> tonic::Status {
    let code = tonic::Code::from_i32(i32::from(status.code().as_u16()));
    let message = crate::server::truncate_error_message(status.message());
    if status.details().is_empty() {
        tonic::Status::new(code, message)
    } else {
        tonic::Status::with_details(code, message, status.details().clone())
    }
}

/// Runs a handler within the request's deadline (its `grpc-timeout`):
/// past it, the caller gets `DEADLINE_EXCEEDED` (not `CANCELLED`, which is
/// what it saw when the client's deadline ran out first).
pub async fn within_deadline<T>(
    deadline: Option<Instant>,
    handler: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, tonic::Status> {
    let outcome = match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline.into(), handler).await {
            Ok(outcome) => outcome,
            Err(_) => {
                return Err(tonic::Status::deadline_exceeded(
                    "the request's deadline passed",
                ));
            }
        },
        None => handler.await,
    };
    outcome.map_err(to_grpc_status)
}

/// How much earlier than its `grpc-timeout` a handler's deadline falls:
/// tonic's server enforces the header itself, from the request's arrival,
/// and answers `CANCELLED` ("Timeout expired"); the bridge's own deadline
/// ([`within_deadline`]), counted from when the handler starts (after the
/// body is decoded and the task scheduled), must come first for the caller
/// to hear `DEADLINE_EXCEEDED`. A quarter of the timeout, at most 100 ms:
/// more than a loaded host's scheduling delay, and a server giving up a
/// little early is what a deadline allows. (Best effort: a handler that
/// starts later than that still lets tonic's `CANCELLED` through.)
fn deadline_margin(timeout: Duration) -> Duration {
    (timeout / 4).min(Duration::from_millis(100))
}

/// Parses a `grpc-timeout` header value: up to 8 digits and a unit
/// (`H`, `M`, `S`, `m`, `u`, `n`), per the gRPC HTTP/2 protocol.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Code;

    #[test]
    fn grpc_timeouts_parse_per_the_protocol() {
        assert_eq!(parse_grpc_timeout("40m"), Some(Duration::from_millis(40)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5u"), Some(Duration::from_micros(5)));
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn status_codes_map_one_to_one() {
        let status = to_grpc_status(Status::new(Code::NotFound, "no table `x`"));
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert_eq!(status.message(), "no table `x`");
        let status = to_grpc_status(Status::new(Code::ResourceExhausted, ""));
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        let status = to_grpc_status(Status::with_details(
            Code::FailedPrecondition,
            "not the primary",
            &b"\x08\x01"[..],
        ));
        assert_eq!(status.details(), b"\x08\x01");
    }
}
