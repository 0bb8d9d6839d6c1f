//! The static description of a service and its methods, as the code
//! generator emits it: names, paths, wire ids ([`method_id`], a hash of the
//! path) and service tags ([`service_tag`]), and which methods are
//! idempotent.

/// Static description of one RPC method, emitted by the code generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodDescriptor {
    /// The method's name in the `.proto` file (`Fetch`).
    pub name: &'static str,
    /// The method's path (`/tessera.ps.v1.ParameterServer/Fetch`).
    pub path: &'static str,
    /// The method's id on the wire: [`method_id`] of `path`.
    pub id: u32,
    /// The tag of the method's service on the wire: [`service_tag`] of the
    /// service's full name. A server refuses a call whose tag is not that
    /// of the service owning the method id it names (ids are hashes: two
    /// services may share one).
    pub service: u16,
    /// Marked `option (tessera.idempotent) = true;` in the `.proto` file: a
    /// second application is harmless, so a call whose outcome is unknown
    /// (timed out, connection lost) may be retried.
    pub idempotent: bool,
}

/// Static description of one service, emitted by the code generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceDescriptor {
    /// The service's full name (`tessera.ps.v1.ParameterServer`).
    pub name: &'static str,
    /// Its methods, in `.proto` order.
    pub methods: &'static [MethodDescriptor],
}

/// The wire tag of a service's full name (`tessera.ps.v1.ParameterServer`):
/// the 32-bit FNV-1a hash of the name with its halves XORed, never 0 (0 on
/// the wire means "not said"). With the method id it makes a misrouted
/// call need two independent collisions.
pub const fn service_tag(service: &str) -> u16 {
    let hash = method_id(service);
    let tag = ((hash >> 16) ^ (hash & 0xffff)) as u16;
    if tag == 0 { 1 } else { tag }
}

/// The wire id of a method path: the 32-bit FNV-1a hash of the path.
///
/// Stable across builds and independent of method order. The code generator
/// computes the same function at build time.
pub const fn method_id(path: &str) -> u32 {
    let bytes = path.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    hash
}
