"""Logistic regression on sparse features, trained through Tessera in plain
NumPy.

Each example has a handful of active features out of many (ids of users,
items, words: the shape of a click model's input). The model keeps one
weight per feature in a parameter-server table of dim 1; a step fetches
the weights of the batch's features, computes the gradient of the log loss
locally and pushes it, and the servers apply it with the table's optimizer.

    python logreg_numpy.py WORKER_CONFIG [--table wide] [--steps 300]

The table must have dim 1, start from zeros, and learn with adagrad whose
``initial_accumulator`` is small (1e-4): a batch's gradient for one
feature is small, and TensorFlow's default accumulator of 0.1 would shrink
its steps tenfold. docs/src/guides/python.md has the table. The data is
synthetic, drawn from a hidden weight vector, so the loss falls towards
what that vector allows. ``train`` returns the mean loss of each step.
"""

import argparse
import sys

import numpy as np

import tessera


def make_data(rng, features: int, examples: int, active: int):
    """Examples of ``active`` feature ids each, labelled by a hidden
    logistic model."""
    hidden = rng.normal(0.0, 1.0, size=features).astype(np.float32)
    ids = rng.integers(0, features, size=(examples, active), dtype=np.uint64)
    logits = hidden[ids.astype(np.int64)].sum(axis=1)
    labels = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return ids, labels


def train(client, table: str, steps: int = 300, batch: int = 128, features: int = 2_000,
          active: int = 8, seed: int = 1, key_offset: int = 0, log_every: int = 50):
    rng = np.random.default_rng(seed)
    ids, labels = make_data(rng, features, 50_000, active)
    losses = []
    for step in range(steps):
        pick = rng.integers(0, len(labels), size=batch)
        x, y = ids[pick], labels[pick]
        # One Fetch per step for the batch's distinct features.
        keys, where = np.unique(x, return_inverse=True)
        where = where.reshape(x.shape)
        keys = keys + np.uint64(key_offset)
        weights = client.fetch(table, keys)[:, 0]  # (n_keys,) float32
        p = 1.0 / (1.0 + np.exp(-weights[where].sum(axis=1)))
        eps = 1e-7
        losses.append(float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps))))
        # d loss / d w_f = mean over examples of (p - y) for each active f.
        grad = np.zeros(len(keys), np.float32)
        np.add.at(grad, where, np.repeat((p - y) / batch, active).reshape(x.shape))
        client.push(table, keys, grad[:, None])
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  log loss {losses[-1]:.4f}", file=sys.stderr)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the worker's config (worker.toml from `tessera up`)")
    parser.add_argument("--table", default="wide")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    client = tessera.Client(args.config)
    losses = train(client, args.table, args.steps)
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    print(f"log loss: first 20 steps {first:.4f}, last 20 steps {last:.4f}")


if __name__ == "__main__":
    main()
