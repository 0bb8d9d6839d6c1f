"""A session with the Python client: fetch rows, push gradients, see the
servers. ``python session.py WORKER_CONFIG [TABLE]``."""

import sys

import numpy as np

import tessera

config = sys.argv[1] if len(sys.argv) > 1 else "run/worker.toml"
table = sys.argv[2] if len(sys.argv) > 2 else "embeddings"

client = tessera.Client(config)  # a path or a dict with the same keys
rows = client.fetch(table, [7, 11, 42])  # float32 ndarray, shape (3, dim)
push_id = client.push(table, [7, 11, 42], np.ones_like(rows))  # applied exactly once
print(f"fetched {rows.shape}, pushed {push_id}")
for address, health in client.health().items():  # a dict, or the error
    print(address, health)
