"""Tessera's exceptions: one class per status code.

Every exception raised by a Tessera call is a :class:`TesseraError` with

- ``code``: the status code's gRPC name (``"UNAVAILABLE"``,
  ``"INVALID_ARGUMENT"``, ...), and
- ``message``: what went wrong, naming the shard and server where one did.

The classes also derive from the built-in exception a Python caller would
expect: :class:`InvalidArgument` is a :class:`ValueError`,
:class:`DeadlineExceeded` a :class:`TimeoutError`, :class:`Unavailable` a
:class:`ConnectionError`, :class:`NotFound` a :class:`LookupError`.

A Push that failed on some shards raises :class:`PushFailed`: the parts
listed in ``acknowledged`` were applied exactly once; retry the same Push
with ``push_id=err.push_id`` to apply the rest without applying any part
twice.
"""

from typing import List, Tuple


class TesseraError(Exception):
    """A Tessera call failed. ``code`` is the status code's gRPC name."""

    code: str
    message: str

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class Cancelled(TesseraError):
    """The call was cancelled."""


class Unknown(TesseraError):
    """An error that fits no other code."""


class InvalidArgument(TesseraError, ValueError):
    """The request or configuration is wrong (a key past the table, a
    gradient array of the wrong shape, an invalid config key)."""


class DeadlineExceeded(TesseraError, TimeoutError):
    """The call's deadline passed before an answer came."""


class NotFound(TesseraError, LookupError):
    """A named thing (such as a table) does not exist."""


class AlreadyExists(TesseraError):
    """The thing to create exists already."""


class PermissionDenied(TesseraError):
    """The caller may not do this (a TLS role is missing)."""


class ResourceExhausted(TesseraError):
    """A limit was reached: a message over ``max_message_size``, a server's
    inbound budget, the client's buffer memory."""


class FailedPrecondition(TesseraError):
    """The system is not in a state that allows the call (a transport that
    cannot start here, a client used in a forked child)."""


class Aborted(TesseraError):
    """The call was aborted (a conflict)."""


class OutOfRange(TesseraError):
    """An argument is outside the valid range."""


class Unimplemented(TesseraError):
    """The server does not implement this call."""


class Internal(TesseraError):
    """An invariant broke (a server or the client answered something that
    cannot be)."""


class Unavailable(TesseraError, ConnectionError):
    """No server could answer (down, unreachable, quarantined); retrying
    later may help."""


class DataLoss(TesseraError):
    """Data was lost or corrupted."""


class Unauthenticated(TesseraError):
    """The caller is not authenticated."""


class PushFailed(TesseraError):
    """Some parts of a Push failed; the others were applied exactly once.

    - ``push_id``: pass it as ``push_id=`` with the same arguments to retry
      the Push exactly once;
    - ``acknowledged``: the ``(table, shard)`` parts that were applied;
    - ``failed``: ``(table, shard, server, code, message)`` of each part that
      failed (whether such a part was applied is unknown: the retry under
      ``push_id`` settles it);
    - ``retriable``: whether every failed part timed out or found no server
      (worth retrying) rather than being refused.
    """

    push_id: int
    acknowledged: List[Tuple[str, int]]
    failed: List[Tuple[str, int, str, str, str]]

    def __init__(
        self,
        message: str,
        code: str,
        push_id: int,
        acknowledged: List[Tuple[str, int]],
        failed: List[Tuple[str, int, str, str, str]],
    ) -> None:
        super().__init__(message, code)
        self.push_id = push_id
        self.acknowledged = list(acknowledged)
        self.failed = list(failed)

    @property
    def retriable(self) -> bool:
        return all(part[3] in ("UNAVAILABLE", "DEADLINE_EXCEEDED") for part in self.failed)


__all__ = [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, TesseraError)]
