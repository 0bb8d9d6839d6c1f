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

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;

use prost_build::{Method, Service};
use prost_types::FileDescriptorSet;
use prost_types::field_descriptor_proto::{Label, Type};

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

/// Reading `(tessera.idempotent)` from a serialized `FileDescriptorSet`.
mod options {
    use std::collections::HashSet;

    use prost::Message;

    #[derive(Clone, PartialEq, Message)]
    struct FileSet {
        #[prost(message, repeated, tag = "1")]
        file: Vec<File>,
    }

    #[derive(Clone, PartialEq, Message)]
    struct File {
        #[prost(string, optional, tag = "2")]
        package: Option<String>,
        #[prost(message, repeated, tag = "6")]
        service: Vec<ServiceProto>,
    }

    #[derive(Clone, PartialEq, Message)]
    struct ServiceProto {
        #[prost(string, optional, tag = "1")]
        name: Option<String>,
        #[prost(message, repeated, tag = "2")]
        method: Vec<MethodProto>,
    }

    #[derive(Clone, PartialEq, Message)]
    struct MethodProto {
        #[prost(string, optional, tag = "1")]
        name: Option<String>,
        #[prost(message, optional, tag = "4")]
        options: Option<MethodOptions>,
    }

    /// `MethodOptions` with only the extension: field 50301 is
    /// `tessera.idempotent` (`proto/tessera/options.proto`).
    #[derive(Clone, PartialEq, Message)]
    struct MethodOptions {
        #[prost(bool, optional, tag = "50301")]
        idempotent: Option<bool>,
    }

    /// Paths (`/package.Service/Method`) of the methods marked idempotent.
    pub fn idempotent_methods(raw: &[u8]) -> std::io::Result<HashSet<String>> {
        let set = FileSet::decode(raw).map_err(std::io::Error::other)?;
        let mut out = HashSet::new();
        for file in &set.file {
            let package = file.package.as_deref().unwrap_or("");
            for service in &file.service {
                let service_name = service.name.as_deref().unwrap_or("");
                let full = if package.is_empty() {
                    service_name.to_owned()
                } else {
                    format!("{package}.{service_name}")
                };
                for method in &service.method {
                    if method.options.as_ref().and_then(|o| o.idempotent) == Some(true) {
                        out.insert(format!("/{full}/{}", method.name.as_deref().unwrap_or("")));
                    }
                }
            }
        }
        Ok(out)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reads_the_option_from_raw_descriptors() {
            let set = FileSet {
                file: vec![File {
                    package: Some("demo.v1".into()),
                    service: vec![ServiceProto {
                        name: Some("Store".into()),
                        method: vec![
                            MethodProto {
                                name: Some("Get".into()),
                                options: Some(MethodOptions {
                                    idempotent: Some(true),
                                }),
                            },
                            MethodProto {
                                name: Some("Put".into()),
                                options: None,
                            },
                            MethodProto {
                                name: Some("Add".into()),
                                options: Some(MethodOptions {
                                    idempotent: Some(false),
                                }),
                            },
                        ],
                    }],
                }],
            };
            let found = idempotent_methods(&set.encode_to_vec()).unwrap();
            assert_eq!(found, HashSet::from(["/demo.v1.Store/Get".to_owned()]));
        }
    }
}

/// A singular `bytes` field that the generated code sends as a part of its
/// own when it is large.
#[derive(Debug, Clone)]
struct BytesField {
    tag: i32,
    /// The field's name in the Rust struct prost generates.
    name: String,
    /// A proto2 `optional` field: prost makes it an `Option<Bytes>`, and a
    /// present empty value must stay present on the wire.
    presence: bool,
}

/// Top-level singular `bytes` fields of every top-level message, keyed by
/// the message's full proto name (`.package.Message`). Fields of a `oneof`
/// (proto3 `optional` is a synthetic one) are left in the message.
fn bytes_fields(fds: &FileDescriptorSet) -> HashMap<String, Vec<BytesField>> {
    let mut out = HashMap::new();
    for file in &fds.file {
        let package = file.package();
        // proto2 unless the file says otherwise (descriptor.proto's rule).
        let proto2 = matches!(file.syntax(), "" | "proto2");
        for message in &file.message_type {
            let full = if package.is_empty() {
                format!(".{}", message.name())
            } else {
                format!(".{package}.{}", message.name())
            };
            let fields: Vec<BytesField> = message
                .field
                .iter()
                .filter(|f| {
                    f.r#type() == Type::Bytes
                        && f.label() != Label::Repeated
                        && f.oneof_index.is_none()
                })
                .map(|f| BytesField {
                    tag: f.number(),
                    name: rust_field_name(f.name()),
                    presence: proto2 && f.label() == Label::Optional,
                })
                .collect();
            out.insert(full, fields);
        }
    }
    out
}

/// `CamelCase` -> `camel_case`, as prost and tonic name things.
fn snake_case(name: &str) -> String {
    let mut snake = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_uppercase() {
            if i > 0 {
                snake.push('_');
            }
            snake.extend(ch.to_lowercase());
        } else {
            snake.push(ch);
        }
    }
    snake
}

/// The name prost gives a field: snake case, raw identifier for keywords.
fn rust_field_name(proto: &str) -> String {
    let snake = snake_case(proto);
    const KEYWORDS: &[&str] = &[
        "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum",
        "extern", "false", "fn", "for", "if", "impl", "in", "let", "loop", "match", "mod", "move",
        "mut", "pub", "ref", "return", "self", "static", "struct", "super", "trait", "true",
        "type", "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final",
        "macro", "override", "priv", "typeof", "unsized", "virtual", "yield", "try", "gen",
    ];
    if KEYWORDS.contains(&snake.as_str()) {
        format!("r#{snake}")
    } else {
        snake
    }
}

/// The 32-bit FNV-1a hash of a method path: the method's id on the wire.
///
/// `tessera_rpc::method_id` computes the same function at run time; a test
/// there checks the generated ids against it.
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

/// The module tonic puts a service's server in (`ParameterServer` ->
/// `parameter_server_server`).
fn tonic_server_module(name: &str) -> String {
    format!("{}_server", snake_case(name))
}

/// `FooGrpc<T>`: serves a Tessera `Foo` implementation through tonic's
/// `foo_server::Foo` trait.
fn generate_grpc_bridge(service: &Service, buf: &mut String) -> std::fmt::Result {
    let full = full_name(service);
    let name = &service.name;
    let module = tonic_server_module(name);
    write!(
        buf,
        r#"/// Serves a [`{name}`] implementation to gRPC clients (tonic): the same
/// handlers as the Tessera endpoint, for clients in any language. Build the
/// tonic service with [`{name}Grpc::service`].
pub struct {name}Grpc<T> {{
    inner: ::std::sync::Arc<T>,
    pool: ::tessera_rpc::grpc::Pool,
}}
impl<T> ::core::fmt::Debug for {name}Grpc<T> {{
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {{
        f.write_str("{name}Grpc")
    }}
}}
impl<T: {name}> {name}Grpc<T> {{
    /// The tonic service for `inner`; handlers build large responses in
    /// `pool`; messages up to `max_message_size` bytes either way (the
    /// Tessera endpoint's limit; tonic's own default is 4 MiB).
    pub fn service(inner: ::std::sync::Arc<T>, pool: ::tessera_rpc::grpc::Pool, max_message_size: usize) -> {module}::{name}Server<Self> {{
        {module}::{name}Server::new(Self {{ inner, pool }})
            .max_decoding_message_size(max_message_size)
            .max_encoding_message_size(max_message_size)
    }}
}}
#[::tonic::async_trait]
impl<T: {name}> {module}::{name} for {name}Grpc<T> {{
"#
    )?;
    for method in &service.methods {
        write!(
            buf,
            r#"    async fn {method}(&self, request: ::tonic::Request<{input}>) -> ::core::result::Result<::tonic::Response<{output}>, ::tonic::Status> {{
        let context = ::tessera_rpc::grpc::request_context(&request, "/{full}/{proto}", &self.pool);
        let deadline = context.deadline;
        ::tessera_rpc::grpc::within_deadline(deadline, self.inner.{method}(context, request.into_inner())).await.map(::tonic::Response::new)
    }}
"#,
            method = method.name,
            input = method.input_type,
            output = method.output_type,
            proto = method.proto_name,
        )?;
    }
    writeln!(buf, "}}")
}

/// Code that turns the owned message `value` into transport message parts:
/// the message without its large `bytes` fields, then each field by itself.
fn encode_parts_expr(
    value: &str,
    proto_type: &str,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    pool: &str,
    map_err: &str,
) -> String {
    match bytes_fields
        .get(proto_type)
        .filter(|fields| !fields.is_empty())
    {
        None => format!(
            "::tessera_rpc::codegen::encode_parts(&{value}, ::std::vec::Vec::new(), {pool}){map_err}"
        ),
        Some(fields) => {
            let mut code = format!("{{ let mut head = {value}; let fields = ::std::vec![");
            for BytesField {
                tag,
                name,
                presence,
            } in fields
            {
                if *presence {
                    // Taken out when it has bytes; a present empty value
                    // (or none) stays in the head, which encodes it as is.
                    let _ = write!(
                        code,
                        "({tag}u32, match head.{name}.take() {{ ::core::option::Option::Some(v) if !v.is_empty() => v, other => {{ head.{name} = other; ::tessera_rpc::codegen::Bytes::new() }} }}),"
                    );
                } else {
                    let _ = write!(code, "({tag}u32, ::core::mem::take(&mut head.{name})),");
                }
            }
            let _ = write!(
                code,
                "]; ::tessera_rpc::codegen::encode_parts(&head, fields, {pool}){map_err} }}"
            );
            code
        }
    }
}

fn full_name(service: &Service) -> String {
    if service.package.is_empty() {
        service.proto_name.clone()
    } else {
        format!("{}.{}", service.package, service.proto_name)
    }
}

fn upper_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(ch.to_uppercase());
    }
    out
}

fn doc_lines(comments: &prost_build::Comments, indent: &str, buf: &mut String) {
    for line in comments.leading.iter().flat_map(|c| c.lines()) {
        let line = line.trim_end();
        if line.is_empty() {
            let _ = writeln!(buf, "{indent}///");
        } else {
            let _ = writeln!(buf, "{indent}/// {}", line.trim_start());
        }
    }
}

fn check_methods(service: &Service, full: &str) {
    let mut seen: HashMap<u32, &str> = HashMap::new();
    for method in &service.methods {
        if method.client_streaming || method.server_streaming {
            panic!(
                "tessera-rpc-build: {full}.{} is a streaming method; Tessera services are unary",
                method.proto_name
            );
        }
        let path = format!("/{full}/{}", method.proto_name);
        if let Some(other) = seen.insert(method_id(&path), &method.proto_name) {
            panic!(
                "tessera-rpc-build: methods {other} and {} of {full} have the same id; rename one",
                method.proto_name
            );
        }
    }
}

fn generate_service(
    service: &Service,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    idempotent: &HashSet<String>,
    buf: &mut String,
) -> std::fmt::Result {
    let full = full_name(service);
    check_methods(service, &full);
    let name = &service.name;
    let descriptor = format!("{}_DESCRIPTOR", upper_snake(name));

    // Descriptor.
    writeln!(
        buf,
        "/// Descriptor of `{full}`: its methods and their wire ids."
    )?;
    writeln!(
        buf,
        "pub static {descriptor}: ::tessera_rpc::ServiceDescriptor = ::tessera_rpc::ServiceDescriptor {{"
    )?;
    writeln!(buf, "    name: \"{full}\",")?;
    writeln!(buf, "    methods: &[")?;
    for method in &service.methods {
        let path = format!("/{full}/{}", method.proto_name);
        writeln!(
            buf,
            "        ::tessera_rpc::MethodDescriptor {{ name: \"{}\", path: \"{path}\", id: {:#010x}, service: ::tessera_rpc::service_tag(\"{full}\"), idempotent: {} }},",
            method.proto_name,
            method_id(&path),
            idempotent.contains(&path)
        )?;
    }
    writeln!(buf, "    ],")?;
    writeln!(buf, "}};")?;

    // Client.
    doc_lines(&service.comments, "", buf);
    if !service.comments.leading.is_empty() {
        writeln!(buf, "///")?;
    }
    writeln!(
        buf,
        "/// Typed client of `{full}` over a Tessera [`::tessera_rpc::Endpoint`]:"
    )?;
    writeln!(
        buf,
        "/// one server ([`::tessera_rpc::Channel`]) or a replica set ([`::tessera_rpc::ReplicaSet`])."
    )?;
    writeln!(buf, "#[derive(Debug, Clone)]")?;
    writeln!(buf, "pub struct {name}Client {{")?;
    writeln!(buf, "    endpoint: ::tessera_rpc::Endpoint,")?;
    writeln!(buf, "}}")?;
    writeln!(buf, "impl {name}Client {{")?;
    writeln!(
        buf,
        "    /// A client that sends its calls to `endpoint` (a `Channel` or a `ReplicaSet`)."
    )?;
    writeln!(
        buf,
        "    pub fn new(endpoint: impl ::core::convert::Into<::tessera_rpc::Endpoint>) -> Self {{"
    )?;
    writeln!(buf, "        Self {{ endpoint: endpoint.into() }}")?;
    writeln!(buf, "    }}")?;
    writeln!(buf, "    /// Where this client sends its calls.")?;
    writeln!(
        buf,
        "    pub fn endpoint(&self) -> &::tessera_rpc::Endpoint {{"
    )?;
    writeln!(buf, "        &self.endpoint")?;
    writeln!(buf, "    }}")?;
    for (index, method) in service.methods.iter().enumerate() {
        let path = format!("/{full}/{}", method.proto_name);
        generate_client_method(
            method,
            index,
            idempotent.contains(&path),
            &descriptor,
            bytes_fields,
            buf,
        )?;
    }
    writeln!(buf, "}}")?;

    // Server trait.
    doc_lines(&service.comments, "", buf);
    if !service.comments.leading.is_empty() {
        writeln!(buf, "///")?;
    }
    writeln!(
        buf,
        "/// Server side of `{full}`: implement it and serve it with [`{name}Server`]."
    )?;
    writeln!(
        buf,
        "pub trait {name}: ::core::marker::Send + ::core::marker::Sync + 'static {{"
    )?;
    for method in &service.methods {
        doc_lines(&method.comments, "    ", buf);
        if method.comments.leading.is_empty() {
            writeln!(buf, "    /// Handles `{}`.", method.proto_name)?;
        }
        writeln!(
            buf,
            "    fn {}(&self, context: ::tessera_rpc::RequestContext, request: {}) -> impl ::core::future::Future<Output = ::core::result::Result<{}, ::tessera_rpc::Status>> + ::core::marker::Send;",
            method.name, method.input_type, method.output_type
        )?;
    }
    writeln!(buf, "}}")?;

    // Dispatcher.
    writeln!(
        buf,
        "/// Routes Tessera requests for `{full}` to a [`{name}`] implementation."
    )?;
    writeln!(buf, "pub struct {name}Server<T> {{")?;
    writeln!(buf, "    inner: ::std::sync::Arc<T>,")?;
    writeln!(buf, "}}")?;
    writeln!(buf, "impl<T> {name}Server<T> {{")?;
    writeln!(buf, "    /// Serves `inner`.")?;
    writeln!(buf, "    pub fn new(inner: T) -> Self {{")?;
    writeln!(
        buf,
        "        Self {{ inner: ::std::sync::Arc::new(inner) }}"
    )?;
    writeln!(buf, "    }}")?;
    writeln!(
        buf,
        "    /// Serves an implementation that is shared with other owners."
    )?;
    writeln!(
        buf,
        "    pub fn from_arc(inner: ::std::sync::Arc<T>) -> Self {{"
    )?;
    writeln!(buf, "        Self {{ inner }}")?;
    writeln!(buf, "    }}")?;
    writeln!(buf, "}}")?;
    writeln!(buf, "impl<T> ::core::clone::Clone for {name}Server<T> {{")?;
    writeln!(buf, "    fn clone(&self) -> Self {{")?;
    writeln!(
        buf,
        "        Self {{ inner: ::std::sync::Arc::clone(&self.inner) }}"
    )?;
    writeln!(buf, "    }}")?;
    writeln!(buf, "}}")?;
    writeln!(buf, "impl<T> ::core::fmt::Debug for {name}Server<T> {{")?;
    writeln!(
        buf,
        "    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {{"
    )?;
    writeln!(buf, "        f.write_str(\"{name}Server\")")?;
    writeln!(buf, "    }}")?;
    writeln!(buf, "}}")?;
    writeln!(
        buf,
        "impl<T: {name}> ::tessera_rpc::Service for {name}Server<T> {{"
    )?;
    writeln!(
        buf,
        "    fn descriptor(&self) -> &'static ::tessera_rpc::ServiceDescriptor {{"
    )?;
    writeln!(buf, "        &{descriptor}")?;
    writeln!(buf, "    }}")?;
    writeln!(
        buf,
        "    fn call(&self, method_id: u32, context: ::tessera_rpc::RequestContext, body: ::tessera_rpc::codegen::Bytes) -> ::tessera_rpc::codegen::BoxFuture<'static, ::core::result::Result<::tessera_rpc::codegen::Message, ::tessera_rpc::Status>> {{"
    )?;
    writeln!(
        buf,
        "        let inner = ::std::sync::Arc::clone(&self.inner);"
    )?;
    writeln!(buf, "        match method_id {{")?;
    for method in &service.methods {
        let path = format!("/{full}/{}", method.proto_name);
        writeln!(
            buf,
            "            {:#010x} => ::std::boxed::Box::pin(async move {{",
            method_id(&path)
        )?;
        writeln!(buf, "                let pool = context.send_pool.clone();")?;
        writeln!(
            buf,
            "                let request = ::tessera_rpc::codegen::decode_request::<{}>(body)?;",
            method.input_type
        )?;
        writeln!(
            buf,
            "                let response = inner.{}(context, request).await?;",
            method.name
        )?;
        writeln!(
            buf,
            "                {}",
            encode_parts_expr(
                "response",
                &method.output_proto_type,
                bytes_fields,
                "&pool",
                ".map_err(::tessera_rpc::codegen::response_encode_error)"
            )
        )?;
        writeln!(buf, "            }}),")?;
    }
    writeln!(
        buf,
        "            other => ::tessera_rpc::codegen::unimplemented(\"{full}\", other),"
    )?;
    writeln!(buf, "        }}")?;
    writeln!(buf, "    }}")?;
    writeln!(buf, "}}")?;
    Ok(())
}

fn generate_client_method(
    method: &Method,
    index: usize,
    idempotent: bool,
    descriptor: &str,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    buf: &mut String,
) -> std::fmt::Result {
    doc_lines(&method.comments, "    ", buf);
    if method.comments.leading.is_empty() {
        writeln!(
            buf,
            "    /// Calls `{}` with the channel's default deadline.",
            method.proto_name
        )?;
    }
    writeln!(
        buf,
        "    pub async fn {}(&self, request: {}) -> ::core::result::Result<{}, ::tessera_rpc::RpcError> {{",
        method.name, method.input_type, method.output_type
    )?;
    writeln!(
        buf,
        "        self.{}_with_options(request, &::tessera_rpc::CallOptions::default()).await",
        method.name
    )?;
    writeln!(buf, "    }}")?;
    writeln!(
        buf,
        "    /// Calls `{}` with per-call options (for example a deadline).",
        method.proto_name
    )?;
    if idempotent {
        writeln!(
            buf,
            "    ///\n    /// The method is idempotent (`tessera.idempotent`): a replica set may retry it after a timeout or a lost connection."
        )?;
    }
    writeln!(
        buf,
        "    pub async fn {}_with_options(&self, request: {}, options: &::tessera_rpc::CallOptions) -> ::core::result::Result<{}, ::tessera_rpc::RpcError> {{",
        method.name, method.input_type, method.output_type
    )?;
    writeln!(buf, "        let pool = self.endpoint.send_pool();")?;
    writeln!(
        buf,
        "        let body = {}?;",
        encode_parts_expr(
            "request",
            &method.input_proto_type,
            bytes_fields,
            pool_ref(),
            ".map_err(::tessera_rpc::codegen::request_encode_error)"
        )
    )?;
    writeln!(
        buf,
        "        self.endpoint.unary_message(&{descriptor}.methods[{index}], body, options).await"
    )?;
    writeln!(buf, "    }}")?;
    Ok(())
}

fn pool_ref() -> &'static str {
    "pool"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_id_is_fnv1a_32() {
        // Reference values of FNV-1a 32.
        assert_eq!(method_id(""), 0x811c_9dc5);
        assert_eq!(method_id("a"), 0xe40c_292c);
        assert_eq!(method_id("foobar"), 0xbf9c_f968);
    }

    #[test]
    fn upper_snake_of_camel_case() {
        assert_eq!(upper_snake("ParameterServer"), "PARAMETER_SERVER");
        assert_eq!(upper_snake("Echo"), "ECHO");
    }
}
