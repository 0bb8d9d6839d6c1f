//! A service's generated code: its descriptor, the typed client, the
//! server trait and the dispatcher the RPC server routes requests to.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::descriptors::{BytesField, method_id};
use prost_build::{Method, Service};

/// Code that turns the owned message `value` into transport message parts:
/// the message without its large `bytes` fields, then each field by itself.
pub(crate) fn encode_parts_expr(
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

pub(crate) fn full_name(service: &Service) -> String {
    if service.package.is_empty() {
        service.proto_name.clone()
    } else {
        format!("{}.{}", service.package, service.proto_name)
    }
}

pub(crate) fn upper_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(ch.to_uppercase());
    }
    out
}

pub(crate) fn doc_lines(comments: &prost_build::Comments, indent: &str, buf: &mut String) {
    for line in comments.leading.iter().flat_map(|c| c.lines()) {
        let line = line.trim_end();
        if line.is_empty() {
            let _ = writeln!(buf, "{indent}///");
        } else {
            let _ = writeln!(buf, "{indent}/// {}", line.trim_start());
        }
    }
}

pub(crate) fn check_methods(service: &Service, full: &str) {
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

pub(crate) fn generate_service(
    service: &Service,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    idempotent: &HashSet<String>,
    buf: &mut String,
) -> std::fmt::Result {
    let full = full_name(service);
    check_methods(service, &full);
    let descriptor = format!("{}_DESCRIPTOR", upper_snake(&service.name));
    generate_descriptor(service, &full, &descriptor, idempotent, buf)?;
    generate_client(service, &full, &descriptor, bytes_fields, idempotent, buf)?;
    generate_server_trait(service, &full, buf)?;
    generate_dispatcher(service, &full, &descriptor, bytes_fields, buf)
}

/// The service's descriptor: its name, and each method's path and wire id.
fn generate_descriptor(
    service: &Service,
    full: &str,
    descriptor: &str,
    idempotent: &HashSet<String>,
    buf: &mut String,
) -> std::fmt::Result {
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
    Ok(())
}

/// The typed client, over a channel or a replica set.
fn generate_client(
    service: &Service,
    full: &str,
    descriptor: &str,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    idempotent: &HashSet<String>,
    buf: &mut String,
) -> std::fmt::Result {
    let name = &service.name;
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
            descriptor,
            bytes_fields,
            buf,
        )?;
    }
    writeln!(buf, "}}")?;
    Ok(())
}

/// The trait a server implements, a method per RPC.
fn generate_server_trait(service: &Service, full: &str, buf: &mut String) -> std::fmt::Result {
    let name = &service.name;
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
    Ok(())
}

/// The dispatcher that routes requests by method id to the trait's
/// methods, decoding requests and encoding responses.
fn generate_dispatcher(
    service: &Service,
    full: &str,
    descriptor: &str,
    bytes_fields: &HashMap<String, Vec<BytesField>>,
    buf: &mut String,
) -> std::fmt::Result {
    let name = &service.name;
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

pub(crate) fn generate_client_method(
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

pub(crate) fn pool_ref() -> &'static str {
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
