//! Worker errors as the package's exceptions (`tessera/_errors.py`): one
//! class per status code, each carrying `code` (the gRPC name, such as
//! `"UNAVAILABLE"`) and `message`; a Push that failed on some shards is
//! `PushFailed`, with its id and parts, for an exactly-once retry.
//!
//! The classes live in Python (docstrings, multiple inheritance from
//! `ValueError`, `TimeoutError`, ... for callers who catch those); this
//! module looks them up when it raises one.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use tessera_rpc::Code;
use tessera_worker::WorkerError;

use crate::runtime::ForkedError;

/// The status code a worker error reports to Python.
fn code_of(err: &WorkerError) -> Code {
    match err {
        WorkerError::Rpc { source, .. } => source.code(),
        WorkerError::Push(failure) => failure
            .failed
            .first()
            .map_or(Code::Unknown, |part| part.source.code()),
        WorkerError::Config(_) | WorkerError::Spec(_) | WorkerError::GradientLength { .. } => {
            Code::InvalidArgument
        }
        WorkerError::NoPrimary(_) => Code::Unavailable,
        WorkerError::Transport(source) => transport_code(source),
        WorkerError::Memory(_) => Code::ResourceExhausted,
        WorkerError::Merge(_) => Code::Internal,
        _ => Code::Unknown,
    }
}

/// The code of a transport that could not be set up: out of memory is
/// `ResourceExhausted`, a bad setting `InvalidArgument`, and the host
/// lacking what the transport needs (an RDMA device, locked memory, a
/// certificate) `FailedPrecondition`.
fn transport_code(err: &tessera_rpc::TransportError) -> Code {
    use tessera_rpc::TransportError;
    match err {
        TransportError::Memory(_) => Code::ResourceExhausted,
        TransportError::Config(_) => Code::InvalidArgument,
        _ => Code::FailedPrecondition,
    }
}

/// gRPC's name of a code: `FailedPrecondition` -> `FAILED_PRECONDITION`.
pub(crate) fn code_name(code: Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// The exception class `name` of `tessera._errors`.
fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("tessera._errors")?.getattr(name)
}

/// An instance of exception class `name` built from `args`.
fn raise<'py>(py: Python<'py>, name: &str, args: Bound<'py, PyTuple>) -> PyErr {
    match class(py, name).and_then(|class| class.call1(args)) {
        Ok(value) => PyErr::from_value(value),
        Err(err) => err,
    }
}

/// `err` as the package's exception.
pub(crate) fn to_py(py: Python<'_>, err: WorkerError) -> PyErr {
    let code = code_of(&err);
    let message = err.to_string();
    if let WorkerError::Push(failure) = err {
        let failed: Vec<(String, u32, String, String, String)> = failure
            .failed
            .iter()
            .map(|part| {
                (
                    part.table.clone(),
                    part.shard,
                    part.addr.clone(),
                    code_name(part.source.code()),
                    part.source.to_string(),
                )
            })
            .collect();
        let args = (
            message,
            code_name(code),
            failure.id.sequence(),
            failure.acknowledged.clone(),
            failed,
        );
        return match args.into_pyobject(py) {
            Ok(args) => raise(py, "PushFailed", args),
            Err(err) => err,
        };
    }
    status_error(py, code, message)
}

/// The exception of status `code` with `message`.
pub(crate) fn status_error(py: Python<'_>, code: Code, message: String) -> PyErr {
    let name = format!("{code:?}");
    match (message, code_name(code)).into_pyobject(py) {
        Ok(args) => raise(py, &name, args),
        Err(err) => err,
    }
}

/// A call from a forked child (see [`crate::runtime`]).
pub(crate) fn forked(py: Python<'_>, err: ForkedError) -> PyErr {
    status_error(py, Code::FailedPrecondition, err.to_string())
}

/// Invalid arguments found before any call was made.
pub(crate) fn invalid(py: Python<'_>, message: String) -> PyErr {
    status_error(py, Code::InvalidArgument, message)
}
