"""An embedding table held by Tessera inside a PyTorch model.

``TesseraEmbedding`` is an autograd Function: forward fetches the rows of
the batch's ids (one Fetch of the distinct ids), backward sums the
gradient of each distinct id and pushes it, and the servers apply it with
the table's optimizer. The rest of the model (here a linear layer on the
mean of each example's embeddings) lives in PyTorch with its own
optimizer, as the dense part of a recommendation model would.

    python torch_embedding.py WORKER_CONFIG [--table embeddings] [--steps 200]

The table's dim is read from the servers' health answer.
"""

import argparse
import sys

import numpy as np
import torch

import tessera


class TesseraEmbedding(torch.autograd.Function):
    """``rows = TesseraEmbedding.apply(weight_anchor, client, table, ids)``.

    ``ids`` is an int64 tensor of any shape; ``rows`` has shape
    ``ids.shape + (dim,)``. ``weight_anchor`` is a tensor that requires
    grad (any one): autograd calls backward only for Functions with an
    input that needs a gradient, and the table itself lives on the
    servers.
    """

    @staticmethod
    def forward(ctx, anchor, client, table, ids):
        keys, where = np.unique(ids.cpu().numpy().astype(np.uint64), return_inverse=True)
        where = where.reshape(ids.shape)
        rows = torch.from_numpy(client.fetch(table, keys))  # shares the array's buffer
        ctx.client, ctx.table, ctx.keys = client, table, keys
        ctx.save_for_backward(torch.from_numpy(where.astype(np.int64)))
        return rows[torch.from_numpy(where.astype(np.int64))]

    @staticmethod
    def backward(ctx, grad_rows):
        (where,) = ctx.saved_tensors
        dim = grad_rows.shape[-1]
        summed = torch.zeros((len(ctx.keys), dim), dtype=torch.float32)
        summed.index_add_(0, where.reshape(-1), grad_rows.reshape(-1, dim).float())
        ctx.client.push(ctx.table, ctx.keys, summed.numpy())
        return torch.zeros(()), None, None, None


class Model(torch.nn.Module):
    def __init__(self, client, table: str, dim: int):
        super().__init__()
        self.client, self.table = client, table
        self.anchor = torch.nn.Parameter(torch.zeros(()))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, ids):
        rows = TesseraEmbedding.apply(self.anchor, self.client, self.table, ids)
        return self.head(rows.mean(dim=1)).squeeze(-1)


def make_data(rng, features: int, examples: int, active: int):
    hidden = rng.normal(0.0, 1.5, size=features)
    ids = rng.integers(0, features, size=(examples, active))
    logits = hidden[ids].mean(axis=1) * 3
    labels = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(labels)


def train(client, table: str, steps: int = 200, batch: int = 128, features: int = 1_000,
          active: int = 6, seed: int = 1, log_every: int = 50):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    ids, labels = make_data(rng, features, 50_000, active)
    dim = next(iter(client.health().values()))["tables"][table]["dim"]
    model = Model(client, table, dim)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.02)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step in range(steps):
        pick = torch.from_numpy(rng.integers(0, len(labels), size=batch))
        loss = loss_fn(model(ids[pick]), labels[pick])
        dense.zero_grad()
        loss.backward()  # pushes the embeddings' gradient
        dense.step()
        losses.append(loss.item())
        if log_every and step % log_every == 0:
            print(f"step {step:4d}  loss {losses[-1]:.4f}", file=sys.stderr)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the worker's config (worker.toml from `tessera up`)")
    parser.add_argument("--table", default="embeddings")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    losses = train(tessera.Client(args.config), args.table, args.steps)
    print(f"loss: first 20 steps {np.mean(losses[:20]):.4f}, last 20 steps {np.mean(losses[-20:]):.4f}")


if __name__ == "__main__":
    main()
