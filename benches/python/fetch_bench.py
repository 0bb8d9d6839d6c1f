"""Python Fetch of 1,000 keys x dim 64: Tessera's native client against
grpcio on the same ps-server's gRPC endpoint, in the same run.

    python benches/python/fetch_bench.py [--bin-dir target/release] [--out benches/results]

Starts one ps-server (release build; table ``emb`` dim 64) serving both
its Tessera endpoint (tcp) and its gRPC endpoint (`grpc_listen`), then
measures, alternating the two clients round by round so that both see the
same machine state:

- latency: one Fetch at a time, p50 / p99 / mean over ``--calls`` calls
  each;
- throughput: ``--threads`` Python threads fetching for ``--seconds`` each.

Both clients hand back a float32 NumPy array of shape (1000, 64): grpcio's
bytes are wrapped with ``numpy.frombuffer`` (no copy), the native client's
rows are the array's own buffer. Writes ``python-fetch.json`` (the
benches/result.schema.json shape) and ``python-fetch.md``. Needs numpy,
grpcio and grpcio-tools, and the ``tessera`` package (``maturin develop
--release`` in python/).
"""

import argparse
import importlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import grpc_tools
import numpy as np
from grpc_tools import protoc

import tessera

REPO = Path(__file__).resolve().parents[2]
KEYS, DIM, TABLE = 1000, 64, "emb"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bin_dir: Path, workdir: Path):
    listen, grpc_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = workdir / "ps.toml"
    config.write_text(
        f'listen = "{listen}"\ngrpc_listen = "{grpc_listen}"\ntransport = "tcp"\n'
        f'[[tables]]\nname = "{TABLE}"\ndim = {DIM}\n'
        'initializer = { kind = "uniform", scale = 0.5 }\n'
    )
    log = open(workdir / "ps.log", "wb")
    process = subprocess.Popen([str(bin_dir / "ps-server"), "--config", str(config)],
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    for address in (listen, grpc_listen):
        host, port = address.rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ps-server did not start: see {log.name}")
                time.sleep(0.05)
    return process, listen, grpc_listen


def grpc_stubs(out_dir: str):
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    args = ["protoc", f"-I{REPO / 'proto'}", f"-I{REPO / 'rpc' / 'build' / 'proto'}",
            f"-I{well_known}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
            "ps.proto", "tessera/options.proto"]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    sys.path.insert(0, out_dir)
    # ps.proto imports tessera/options.proto, whose generated module is
    # `tessera.options_pb2`: let this process's `tessera` package (the
    # client) find it too.
    tessera.__path__.append(os.path.join(out_dir, "tessera"))
    return importlib.import_module("ps_pb2"), importlib.import_module("ps_pb2_grpc")


def percentile(samples, q):
    return float(np.percentile(np.asarray(samples), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=REPO / "target" / "release")
    parser.add_argument("--out", type=Path, default=REPO / "benches" / "results")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    started = time.time()
    workdir = Path(tempfile.mkdtemp(prefix="tessera-pybench-"))
    process, listen, grpc_listen = start_server(args.bin_dir, workdir)
    try:
        ps_pb2, ps_pb2_grpc = grpc_stubs(str(workdir))
        native = tessera.Client({"num_shards": 1, "servers": [
            {"address": listen, "shards": [0], "replica_group": 0}]})
        channel = grpc.insecure_channel(grpc_listen, options=[
            ("grpc.max_receive_message_length", 64 << 20)])
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        keys = np.arange(1, KEYS + 1, dtype=np.uint64)
        key_list = keys.tolist()

        def via_native():
            return native.fetch(TABLE, keys)

        def via_grpc():
            answer = stub.Fetch(ps_pb2.FetchRequest(table=TABLE, shard=0, keys=key_list),
                                timeout=10)
            return np.frombuffer(answer.values, dtype=np.float32).reshape(len(key_list), answer.dim)

        clients = {"native": via_native, "grpcio": via_grpc}
        # Same rows through both, then warm both up.
        np.testing.assert_array_equal(via_native(), via_grpc())
        for call in clients.values():
            for _ in range(100):
                call()

        latencies = {name: [] for name in clients}
        for _ in range(args.calls // 50):
            for name, call in clients.items():
                for _ in range(50):
                    t = time.perf_counter_ns()
                    rows = call()
                    latencies[name].append((time.perf_counter_ns() - t) / 1000)
                    assert rows.shape == (KEYS, DIM)

        throughput = {}
        for name, call in clients.items():
            counts = [0] * args.threads
            stop = time.monotonic() + args.seconds

            def loop(i, call=call, stop=stop, counts=counts):
                while time.monotonic() < stop:
                    call()
                    counts[i] += 1

            pool = [threading.Thread(target=loop, args=(i,)) for i in range(args.threads)]
            t = time.monotonic()
            for th in pool:
                th.start()
            for th in pool:
                th.join()
            throughput[name] = sum(counts) / (time.monotonic() - t)
    finally:
        process.terminate()
        process.wait(timeout=30)

    rows = []
    for name in clients:
        lat = latencies[name]
        rows.append({
            "client": name,
            "keys": KEYS,
            "dim": DIM,
            "calls": len(lat),
            "p50_us": round(percentile(lat, 50), 1),
            "p99_us": round(percentile(lat, 99), 1),
            "mean_us": round(float(np.mean(lat)), 1),
            "threads": args.threads,
            "fetches_per_sec": round(throughput[name], 1),
            "rows_per_sec": round(throughput[name] * KEYS, 0),
        })
    base = rows[1]  # grpcio: what a user would otherwise pick
    for row in rows:
        row["p50_vs_grpcio"] = round(row["p50_us"] / base["p50_us"], 3)
        row["p99_vs_grpcio"] = round(row["p99_us"] / base["p99_us"], 3)
        row["throughput_vs_grpcio"] = round(row["fetches_per_sec"] / base["fetches_per_sec"], 3)

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown")
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    command = "python " + " ".join([str(Path(sys.argv[0]))] + sys.argv[1:])
    meta = {"command": command, "git_rev": rev, "cores": os.cpu_count(),
            "memory_gib": round(mem_gib, 1), "cpu_model": cpu, "started_unix": int(started),
            "duration_s": round(time.time() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "python-fetch.json").write_text(
        json.dumps({"bench": "python-fetch", "meta": meta, "rows": rows}, indent=2) + "\n")
    columns = list(rows[0].keys())
    md = [
        f"Machine: {meta['cores']} cores, {meta['memory_gib']} GiB, {cpu}; revision {rev}; "
        f"`{command}` ({meta['duration_s']} s). Absolute figures are this machine's; ratios "
        "are to grpcio in the same run.",
        "",
        f"python-fetch: one ps-server (release, tcp, loopback), Fetch of {KEYS} keys x dim {DIM} "
        f"into a float32 NumPy array from Python; latency one call at a time ({len(latencies['native'])} "
        f"calls each, alternating rounds of 50), throughput from {args.threads} Python threads for "
        f"{args.seconds} s",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if isinstance(rows[0][c], (int, float)) else "---" for c in columns) + "|",
    ]
    for row in rows:
        md.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    (args.out / "python-fetch.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
