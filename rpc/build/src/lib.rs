//! Build-time code generation for Tessera services.
//!
//! [`ServiceGenerator`] plugs into `prost_build` and emits, for every service
//! in a `.proto` file, a typed async client (`FooClient`), a server trait
//! (`Foo`) whose methods the application implements, a dispatcher
//! (`FooServer<T>`) that the Tessera RPC server routes requests to, and a
//! static descriptor (`FOO_DESCRIPTOR`) listing the methods and their ids.
//!
//! Method ids are the 32-bit FNV-1a hash of the method's path
//! (`/package.Service/Method`): they are stable across builds and
//! independent of method order, so adding a method never renumbers the
//! others. Two methods of one service that hash alike fail the build.
//!
//! Large `bytes` fields are sent without being copied into the encoded
//! message: [`compile_protos`] reads the descriptors first, and for every
//! request and response type with top-level `bytes` fields the generated
//! code encodes the rest of the message, then appends each such field's key
//! and length followed by the field's own buffer as a separate part of the
//! transport message (protobuf accepts fields in any order). The transport
//! writes the parts with one vectored write.
//!
//! Methods marked `option (tessera.idempotent) = true;` (from
//! `tessera/options.proto`, which [`compile_protos`] puts on the include
//! path) get `idempotent: true` in their [`MethodDescriptor`]s, and the RPC
//! layer may retry them after a timeout or a lost connection. prost drops
//! unknown options when it decodes descriptors, so the option is read from
//! protoc's raw output with a small mirror of the descriptor messages.
//!
//! [`MethodDescriptor`]: https://docs.rs/tessera-rpc
//!
//! Use [`compile_protos`] from a `build.rs`:
//!
//! ```no_run
//! tessera_rpc_build::compile_protos(&["proto/echo.proto"], &["proto"]).unwrap();
//! ```
//!
//! Files: `descriptors.rs` reads what prost's view of the descriptors
//! leaves out (the idempotent option, the `bytes` fields);
//! `service.rs` writes a service's descriptor, client, server trait and
//! dispatcher; `grpc.rs` the bridge to tonic's server trait.

mod descriptors;
mod grpc;
mod service;

pub use descriptors::method_id;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use descriptors::{BytesField, bytes_fields, options};
use grpc::generate_grpc_bridge;
use prost_build::Service;
use service::generate_service;

/// A `prost_build::Config` with Tessera's service generator installed and
/// every `bytes` field generated as `bytes::Bytes` (so decoded payloads share
/// the receive buffer instead of being copied into a `Vec`).
///
/// Code generated this way encodes messages whole; [`compile_protos`] also
/// sends large `bytes` fields without copying them.
pub fn configure() -> prost_build::Config {
    let mut config = prost_build::Config::new();
    config.service_generator(Box::new(ServiceGenerator::default()));
    config.bytes(["."]);
    config
}

/// Compiles `protos` (searching `includes`) with Tessera's generator, with
/// zero-copy encoding of top-level `bytes` fields of request and response
/// types.
///
/// The directory of `tessera/options.proto` is added to `includes`.
pub fn compile_protos(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> std::io::Result<()> {
    Builder::new().compile(protos, includes)
}

/// Code generation with options; [`compile_protos`] is `Builder::new().compile(..)`.
#[derive(Debug, Clone, Default)]
pub struct Builder {
    grpc: bool,
}

impl Builder {
    /// Tessera stubs only.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also generate a gRPC endpoint for every service: tonic's server
    /// module (`foo_server`, from tonic-prost-build) next to the Tessera
    /// code, and a bridge `FooGrpc<T>` that serves any implementation of
    /// the Tessera trait `Foo` to gRPC clients. The crate then depends on
    /// `tonic` and `tonic-prost`.
    pub fn grpc(mut self, enable: bool) -> Self {
        self.grpc = enable;
        self
    }

    /// Compiles `protos`, searching `includes` (and the directory of
    /// `tessera/options.proto`).
    pub fn compile(
        self,
        protos: &[impl AsRef<Path>],
        includes: &[impl AsRef<Path>],
    ) -> std::io::Result<()> {
        compile(self, protos, includes)
    }
}

fn compile(
    builder: Builder,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> std::io::Result<()> {
    let out_dir = std::env::var_os("OUT_DIR")
        .map(std::path::PathBuf::from)
        .ok_or_else(|| {
            std::io::Error::other("OUT_DIR is not set: call this from a build script")
        })?;
    let fds_path = out_dir.join("tessera-descriptors.bin");
    let mut config = prost_build::Config::new();
    config.bytes(["."]);
    config.file_descriptor_set_path(&fds_path);
    let mut all_includes: Vec<std::path::PathBuf> =
        includes.iter().map(|i| i.as_ref().to_path_buf()).collect();
    all_includes.push(options_include_dir());
    let fds = config.load_fds(protos, &all_includes)?;
    let raw = std::fs::read(&fds_path)?;
    let grpc = builder.grpc.then(|| {
        tonic_prost_build::configure()
            .build_client(false)
            .build_server(true)
            .service_generator()
    });
    config.service_generator(Box::new(ServiceGenerator {
        bytes_fields: bytes_fields(&fds),
        idempotent: options::idempotent_methods(&raw)?,
        grpc,
    }));
    config.compile_fds(fds)
}

/// The directory holding `tessera/options.proto`.
pub fn options_include_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("proto")
}

/// Emits Tessera clients, server traits and dispatchers (and, with a gRPC
/// generator, tonic's server module and a bridge to it).
#[derive(Default)]
pub struct ServiceGenerator {
    /// Zero-copy `bytes` fields per message (empty without descriptors).
    bytes_fields: HashMap<String, Vec<BytesField>>,
    /// Paths of the methods marked `(tessera.idempotent)`.
    idempotent: HashSet<String>,
    /// tonic-prost-build's generator, when a gRPC endpoint is wanted.
    grpc: Option<Box<dyn prost_build::ServiceGenerator>>,
}

impl std::fmt::Debug for ServiceGenerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceGenerator")
            .field("grpc", &self.grpc.is_some())
            .finish_non_exhaustive()
    }
}

impl prost_build::ServiceGenerator for ServiceGenerator {
    fn generate(&mut self, service: Service, buf: &mut String) {
        // Writing into a String cannot fail.
        let _ = generate_service(&service, &self.bytes_fields, &self.idempotent, buf);
        if let Some(grpc) = &mut self.grpc {
            grpc.generate(service.clone(), buf);
            let _ = generate_grpc_bridge(&service, buf);
        }
    }

    fn finalize(&mut self, buf: &mut String) {
        if let Some(grpc) = &mut self.grpc {
            grpc.finalize(buf);
        }
    }

    fn finalize_package(&mut self, package: &str, buf: &mut String) {
        if let Some(grpc) = &mut self.grpc {
            grpc.finalize_package(package, buf);
        }
    }
}
