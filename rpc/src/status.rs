//! A call's outcome as the wire carries it: a [`Code`] (gRPC's codes, so
//! that the gRPC endpoint maps one to one) and a [`Status`] with its
//! message and optional details.

use std::fmt;

use bytes::Bytes;

/// Status codes, numbered as gRPC numbers them so that a status maps
/// one-to-one onto a gRPC status when the same handlers are served over gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u16)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// The caller cancelled the call.
    Cancelled = 1,
    /// An error that fits no other code.
    Unknown = 2,
    /// The request is malformed or its arguments are wrong.
    InvalidArgument = 3,
    /// The deadline passed before the call completed.
    DeadlineExceeded = 4,
    /// A named entity (table, key) does not exist.
    NotFound = 5,
    /// The entity to create already exists.
    AlreadyExists = 6,
    /// The caller may not do this.
    PermissionDenied = 7,
    /// A resource (memory, a quota) is exhausted.
    ResourceExhausted = 8,
    /// The system is not in a state that allows the operation (for example
    /// a key sent to a server that does not host its shard).
    FailedPrecondition = 9,
    /// The operation was aborted (for example by a conflict).
    Aborted = 10,
    /// An argument is outside the valid range.
    OutOfRange = 11,
    /// The method is not implemented by this server.
    Unimplemented = 12,
    /// An invariant of the server broke.
    Internal = 13,
    /// The service is unavailable: retrying elsewhere or later may help.
    Unavailable = 14,
    /// Data was lost or corrupted.
    DataLoss = 15,
    /// The caller is not authenticated.
    Unauthenticated = 16,
}

impl Code {
    /// The code for a wire value; unknown values become [`Code::Unknown`].
    pub fn from_u16(value: u16) -> Code {
        match value {
            0 => Code::Ok,
            1 => Code::Cancelled,
            3 => Code::InvalidArgument,
            4 => Code::DeadlineExceeded,
            5 => Code::NotFound,
            6 => Code::AlreadyExists,
            7 => Code::PermissionDenied,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            10 => Code::Aborted,
            11 => Code::OutOfRange,
            12 => Code::Unimplemented,
            13 => Code::Internal,
            14 => Code::Unavailable,
            15 => Code::DataLoss,
            16 => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }

    /// The wire value.
    pub fn as_u16(self) -> u16 {
        self as u16
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// An error status returned by a handler and carried back to the caller:
/// a code, a message for people, and optional details for programs (an
/// encoded protobuf message the service defines, as gRPC's
/// `grpc-status-details-bin`), so that a caller never has to parse the
/// message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Status {
    code: Code,
    message: String,
    details: Bytes,
}

impl Status {
    /// A status with `code` and a human-readable `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            details: Bytes::new(),
        }
    }

    /// A status with `code`, `message` and machine-readable `details` (an
    /// encoded message whose type the service documents).
    pub fn with_details(code: Code, message: impl Into<String>, details: impl Into<Bytes>) -> Self {
        Self {
            code,
            message: message.into(),
            details: details.into(),
        }
    }

    /// The details (empty when there are none).
    pub fn details(&self) -> &Bytes {
        &self.details
    }

    /// The status code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// [`Code::InvalidArgument`].
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// [`Code::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// [`Code::FailedPrecondition`].
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, message)
    }

    /// [`Code::Unimplemented`].
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(Code::Unimplemented, message)
    }

    /// [`Code::Internal`].
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// [`Code::Unavailable`].
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, message)
    }

    /// [`Code::DeadlineExceeded`].
    pub fn deadline_exceeded(message: impl Into<String>) -> Self {
        Self::new(Code::DeadlineExceeded, message)
    }

    /// [`Code::ResourceExhausted`].
    pub fn resource_exhausted(message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, message)
    }

    /// [`Code::PermissionDenied`].
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, message)
    }
}

impl Code {
    /// The code's name in snake case (`ok`, `deadline_exceeded`), a
    /// `'static` string: the `code` label of every metric (labels must
    /// not allocate per call).
    pub fn label(self) -> &'static str {
        match self {
            Code::Ok => "ok",
            Code::Cancelled => "cancelled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
            _ => "unknown",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_its_wire_value() {
        for value in 0..=16u16 {
            assert_eq!(Code::from_u16(value).as_u16(), value);
        }
        assert_eq!(Code::from_u16(999), Code::Unknown);
    }
}
