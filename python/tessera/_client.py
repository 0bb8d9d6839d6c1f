"""Client and AsyncClient: the Python face of Tessera's worker client."""

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _errors, _native

Config = Union[str, "os.PathLike[str]", Mapping[str, Any]]
Keys = Any  # any 1-D array-like of non-negative integers
Rows = np.ndarray


def _keys(keys: Keys) -> np.ndarray:
    """``keys`` as a contiguous 1-D uint64 array: the array itself when it
    is one already (no copy), else one converted copy."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64 and keys.ndim == 1:
        return keys if keys.flags.c_contiguous else np.ascontiguousarray(keys)
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise _errors.InvalidArgument(f"keys must be 1-D, got shape {arr.shape}", "INVALID_ARGUMENT")
    if arr.size == 0:
        return np.empty(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise _errors.InvalidArgument(
            f"keys must be integers, got dtype {arr.dtype}", "INVALID_ARGUMENT"
        )
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise _errors.InvalidArgument("keys must not be negative", "INVALID_ARGUMENT")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def _gradients(gradients: Any, n: int) -> np.ndarray:
    """``gradients`` as a C-contiguous float32 array of shape (n, dim): the
    array itself when it is one already (no copy), else one converted copy.
    A 1-D array of ``n * dim`` values is taken as ``n`` rows."""
    arr = np.asarray(gradients)
    if arr.dtype != np.float32 or not arr.flags.c_contiguous:
        if arr.dtype.kind not in "fiu":
            raise _errors.InvalidArgument(
                f"gradients must be numbers, got dtype {arr.dtype}", "INVALID_ARGUMENT"
            )
        arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 and n > 0 and arr.size % n == 0:
        arr = arr.reshape(n, arr.size // n)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise _errors.InvalidArgument(
            f"gradients must have shape ({n}, dim) for {n} keys, got {arr.shape}",
            "INVALID_ARGUMENT",
        )
    return arr


def _native_client(config: Config, overrides: Dict[str, Any]) -> "_native.Client":
    over = json.dumps(overrides) if overrides else None
    if isinstance(config, Mapping):
        return _native.Client(json=json.dumps(dict(config)), overrides=over)
    if isinstance(config, (str, os.PathLike)):
        return _native.Client(path=os.fspath(config), overrides=over)
    raise TypeError(f"config must be a path or a dict, not {type(config).__name__}")


class _Base:
    """What Client and AsyncClient share: the native client and its ids."""

    _native: "_native.Client"

    def __init__(self, config: Config, **overrides: Any) -> None:
        self._native = _native_client(config, overrides)

    @property
    def worker_id(self) -> int:
        """This client's id in Push deduplication (random, never 0)."""
        return self._native.worker_id

    @property
    def num_shards(self) -> int:
        """The model's number of shards."""
        return self._native.num_shards

    def next_push_id(self) -> int:
        """A fresh Push id, for a caller that wants it before the first try."""
        return self._native.next_push_id()

    def __repr__(self) -> str:
        return f"tessera.{type(self).__name__}(worker_id={self.worker_id:#x}, num_shards={self.num_shards})"


class Client(_Base):
    """A client of a sharded, replicated Tessera parameter server.

    ``Client(config)`` takes a worker configuration: the path of a TOML file
    (the ``worker.toml`` that ``tessera up`` writes, or one written by hand)
    or a dict of the same keys, for example::

        client = tessera.Client({
            "num_shards": 2,
            "servers": [
                {"address": "10.0.1.11:7000", "shards": [0, 1], "replica_group": 0},
                {"address": "10.0.2.11:7000", "shards": [0, 1], "replica_group": 1},
            ],
            "transport": "tcp",       # or "rdma" (with "rdma": {"provider": ...}) or "auto"
        })

    Keyword arguments override the configuration's keys (a dict value is
    merged into the table of that name)::

        client = tessera.Client("run/worker.toml", call_timeout_ms=500,
                                transport="rdma", rdma={"provider": "soft"})

    The keys are the worker's (docs/src/reference/configuration.md,
    ``worker``); an unknown or invalid one raises
    :class:`tessera.InvalidArgument` naming it.

    Fetch splits the keys by shard and asks each shard's replicas
    concurrently (own replica group first, retries within the call's
    deadline, quarantine of failing servers, RDMA-to-TCP fallback). Push
    sums the gradients of repeated keys and sends each shard's part to its
    primary, which applies it exactly once, even when an answer is lost and
    the Push is retried, and replicates it.

    Arrays: keys are any 1-D integer array-like (a ``uint64`` NumPy array is
    read in place, anything else is converted once); gradients are
    ``float32`` of shape ``(len(keys), dim)`` (read in place when C-contiguous
    ``float32``, else converted once). Fetched rows are a new ``float32``
    array of shape ``(len(keys), dim)`` that owns its memory: the rows are
    copied exactly once, from the transport's receive buffers into the
    array, in key order. (The receive buffers are not handed out as arrays:
    they hold several shards' answers in the servers' order and are the
    transport's, RDMA credits included, for as long as an array would live.)
    Fetching no keys returns shape ``(0, 0)``.

    Threads: the interpreter lock is released while a call waits on the
    network, so calls from several threads run concurrently on the same
    connections. One client per process is enough; it is safe to share.
    Do not use a client (or create one) in a process forked from one that
    used Tessera: it raises ``FailedPrecondition`` (use multiprocessing's
    ``spawn`` start method).

    Errors raise :class:`tessera.TesseraError` subclasses carrying ``code``
    and ``message`` (see ``tessera._errors``).

    The same calls as coroutines: :class:`tessera.AsyncClient`, or
    ``client.aio`` on an existing client (same connections).
    """

    @property
    def aio(self) -> "AsyncClient":
        """This client's calls as coroutines (the same connections)."""
        return AsyncClient._wrap(self._native)

    def fetch(self, table: str, keys: Keys) -> Rows:
        """The rows of ``keys`` in ``table``: ``float32``, shape
        ``(len(keys), dim)``, row ``i`` for ``keys[i]`` (repeated keys are
        fetched once and returned at each place)."""
        return self._native.fetch(table, _keys(keys))

    def fetch_many(self, specs: Sequence[Tuple[str, Keys]]) -> List[Rows]:
        """Rows of several tables at once: ``[(table, keys), ...]`` ->
        ``[rows, ...]``; every table's shards are asked concurrently."""
        return self._native.fetch_many([(t, _keys(k)) for t, k in specs])

    def push(self, table: str, keys: Keys, gradients: Any, push_id: Optional[int] = None) -> int:
        """Applies ``gradients`` (shape ``(len(keys), dim)``) to the rows of
        ``keys`` in ``table`` with the table's optimizer; gradients of
        repeated keys are summed. Applied exactly once, retries included.
        Returns the Push's id.

        On :class:`tessera.PushFailed` (some shards failed), call again with
        the same arguments and ``push_id=err.push_id``: the parts already
        applied are not applied again."""
        keys = _keys(keys)
        return self._native.push(table, keys, _gradients(gradients, len(keys)), push_id)

    def push_many(
        self, specs: Sequence[Tuple[str, Keys, Any]], push_id: Optional[int] = None
    ) -> int:
        """One Push of several tables: ``[(table, keys, gradients), ...]``
        under one id (see :meth:`push`)."""
        return self._native.push_many(_push_specs(specs), push_id)

    def primary(self, shard: int) -> Optional[Tuple[str, int]]:
        """The server ``shard``'s Pushes go to now, and its epoch."""
        return self._native.primary(shard)

    def quarantined(self, shard: int) -> List[str]:
        """The servers of ``shard`` that Fetches avoid now (quarantined)."""
        return self._native.quarantined(shard)

    def transports(self, shard: int) -> Dict[str, Optional[str]]:
        """How ``shard``'s Fetches reach each of its servers now: ``"tcp"``,
        ``"rdma"``, or None when not connected (with ``transport = "auto"``
        or after an RDMA-to-TCP fallback, this says which one is in use)."""
        return dict(self._native.transports(shard))

    def health(self) -> Dict[str, Union[Dict[str, Any], _errors.TesseraError]]:
        """Every server's health, by address: a dict (``serving``, ``state``,
        ``shards``, ``primary_shards``, ``replica_group``, ``transport``,
        ``tables``: name -> ``{dim, rows}``) or the exception its call
        raised."""
        return dict(self._native.health())



def _push_specs(specs: Sequence[Tuple[str, Keys, Any]]) -> list:
    out = []
    for table, keys, gradients in specs:
        keys = _keys(keys)
        out.append((table, keys, _gradients(gradients, len(keys))))
    return out


class AsyncClient(_Base):
    """:class:`Client`'s calls as asyncio coroutines::

        client = tessera.AsyncClient("run/worker.toml")
        rows = await client.fetch("embeddings", keys)
        await client.push("embeddings", keys, grads)

    The calls run on the same runtime (and, through ``Client.aio``, the same
    connections) as the blocking ones; many may be awaited at once
    (``asyncio.gather``). Arrays, errors and exactly-once Push as for
    :class:`Client`."""

    @classmethod
    def _wrap(cls, native: "_native.Client") -> "AsyncClient":
        client = cls.__new__(cls)
        client._native = native
        return client

    async def fetch(self, table: str, keys: Keys) -> Rows:
        """See :meth:`Client.fetch`."""
        return await self._native.fetch_async(table, _keys(keys))

    async def fetch_many(self, specs: Sequence[Tuple[str, Keys]]) -> List[Rows]:
        """See :meth:`Client.fetch_many`."""
        return await self._native.fetch_many_async([(t, _keys(k)) for t, k in specs])

    async def push(
        self, table: str, keys: Keys, gradients: Any, push_id: Optional[int] = None
    ) -> int:
        """See :meth:`Client.push`."""
        keys = _keys(keys)
        return await self._native.push_many_async(
            [(table, keys, _gradients(gradients, len(keys)))], push_id
        )

    async def push_many(
        self, specs: Sequence[Tuple[str, Keys, Any]], push_id: Optional[int] = None
    ) -> int:
        """See :meth:`Client.push_many`."""
        return await self._native.push_many_async(_push_specs(specs), push_id)

