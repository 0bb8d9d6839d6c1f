//! What the descriptors say beyond prost's view: the `(tessera.idempotent)`
//! option, and the top-level `bytes` fields sent as parts of their own.

use std::collections::HashMap;

use prost_types::FileDescriptorSet;
use prost_types::field_descriptor_proto::{Label, Type};

/// Reading `(tessera.idempotent)` from a serialized `FileDescriptorSet`.
pub(crate) mod options {
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
pub(crate) struct BytesField {
    pub(crate) tag: i32,
    /// The field's name in the Rust struct prost generates.
    pub(crate) name: String,
    /// A proto2 `optional` field: prost makes it an `Option<Bytes>`, and a
    /// present empty value must stay present on the wire.
    pub(crate) presence: bool,
}

/// Top-level singular `bytes` fields of every top-level message, keyed by
/// the message's full proto name (`.package.Message`). Fields of a `oneof`
/// (proto3 `optional` is a synthetic one) are left in the message.
pub(crate) fn bytes_fields(fds: &FileDescriptorSet) -> HashMap<String, Vec<BytesField>> {
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
pub(crate) fn snake_case(name: &str) -> String {
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
pub(crate) fn rust_field_name(proto: &str) -> String {
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
