"""A gRPC client of a ps-server in Python, built only from the .proto files.

Usage: grpc_client.py ADDRESS PROTO_DIR OPTIONS_DIR

Generates the Python stubs from ps.proto (and the tessera/options.proto it
imports) with grpc_tools.protoc into a temporary directory, then calls
Health, Fetch, Push and Fetch again on ADDRESS and checks the answers:
the rows move by -learning_rate * gradient (SGD, learning rate 0.5 in the
test's table), and an unknown table is NOT_FOUND. Prints one JSON line with
what it saw; exits non-zero on any mismatch.
"""

import importlib
import json
import os
import struct
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc


def generate(proto_dir, options_dir, out_dir):
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"-I{options_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "ps.proto",
        "tessera/options.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def floats(raw):
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def main():
    address, proto_dir, options_dir = sys.argv[1:4]
    out_dir = tempfile.mkdtemp(prefix="tessera-grpc-py-")
    generate(proto_dir, options_dir, out_dir)
    sys.path.insert(0, out_dir)
    ps_pb2 = importlib.import_module("ps_pb2")
    ps_pb2_grpc = importlib.import_module("ps_pb2_grpc")

    with grpc.insecure_channel(address) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        health = stub.Health(ps_pb2.HealthRequest(), timeout=10)
        assert health.serving, health
        table = health.tables[0]
        dim = table.dim

        keys = [7, 11, 7000001]
        before = stub.Fetch(
            ps_pb2.FetchRequest(table=table.name, shard=0, keys=keys), timeout=10
        )
        assert before.dim == dim, (before.dim, dim)
        rows_before = floats(before.values)
        assert len(rows_before) == len(keys) * dim

        gradients = [float(i % 5) for i in range(len(keys) * dim)]
        pushed = stub.Push(
            ps_pb2.PushRequest(
                table=table.name,
                shard=0,
                keys=keys,
                gradients=struct.pack(f"<{len(gradients)}f", *gradients),
            ),
            timeout=10,
        )
        assert pushed.applied == len(keys), pushed

        after = floats(
            stub.Fetch(
                ps_pb2.FetchRequest(table=table.name, shard=0, keys=keys), timeout=10
            ).values
        )
        expected = [b - 0.5 * g for b, g in zip(rows_before, gradients)]
        worst = max(abs(a - e) for a, e in zip(after, expected))
        assert worst < 1e-5, (worst, after[:4], expected[:4])

        try:
            stub.Fetch(ps_pb2.FetchRequest(table="no-such-table", shard=0, keys=[1]), timeout=10)
            raise SystemExit("an unknown table was answered")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err.code()
            not_found = err.details()

    print(
        json.dumps(
            {
                "dim": dim,
                "rows": len(keys),
                "applied": pushed.applied,
                "max_error": worst,
                "unknown_table": not_found,
            }
        )
    )


if __name__ == "__main__":
    main()
