//! The gRPC bridge: a Tessera service implementation served through
//! tonic's generated server trait.

use std::fmt::Write as _;

use crate::descriptors::snake_case;
use crate::service::full_name;
use prost_build::Service;

/// The module tonic puts a service's server in (`ParameterServer` ->
/// `parameter_server_server`).
pub(crate) fn tonic_server_module(name: &str) -> String {
    format!("{}_server", snake_case(name))
}

/// `FooGrpc<T>`: serves a Tessera `Foo` implementation through tonic's
/// `foo_server::Foo` trait.
pub(crate) fn generate_grpc_bridge(service: &Service, buf: &mut String) -> std::fmt::Result {
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
