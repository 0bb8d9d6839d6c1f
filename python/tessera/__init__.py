"""Tessera: the Python client of the Tessera parameter server.

Fetch embedding rows from, and push gradients to, a sharded, replicated
Tessera parameter server, over TCP or RDMA, with the Rust worker client's
replica selection, retries, quarantine and exactly-once Push::

    import numpy as np, tessera
    client = tessera.Client("run/worker.toml")        # written by `tessera up`
    keys = np.array([3, 14, 15, 92], dtype=np.uint64)
    rows = client.fetch("embeddings", keys)           # float32, shape (4, dim)
    client.push("embeddings", keys, np.ones_like(rows))

- :class:`Client`: blocking calls (the interpreter lock is released while
  they wait, so threads run them concurrently);
- :class:`AsyncClient` (or ``client.aio``): the same calls as coroutines;
- exceptions: :class:`TesseraError` and one subclass per status code
  (:class:`Unavailable`, :class:`InvalidArgument`, ...), and
  :class:`PushFailed` for a Push to retry exactly once.
"""

from ._client import AsyncClient, Client
from ._errors import *  # noqa: F401,F403 (the exception classes)
from ._errors import __all__ as _error_names
from ._native import __version__

__all__ = ["Client", "AsyncClient", "__version__", *_error_names]
