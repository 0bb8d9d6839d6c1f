/// Static description of one RPC method, emitted by the code generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodDescriptor {
    /// The method's name in the `.proto` file (`Fetch`).
    pub name: &'static str,
    /// The method's path (`/tessera.ps.v1.ParameterServer/Fetch`).
    pub path: &'static str,
    /// The method's id on the wire: [`method_id`] of `path`.
    pub id: u32,
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
