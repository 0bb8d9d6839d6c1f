"""Shared set-up of the Python client's tests: a local cluster started with
`tessera up`, the Rust worker client as a reference, and a TCP proxy that
loses answers."""

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("TESSERA_BIN_DIR", REPO / "target" / "debug"))

TRANSPORTS = {
    "tcp": 'transport = "tcp"\n',
    "rdma-soft": 'transport = "rdma"\n[rdma]\nprovider = "soft"\n',
}


def binary(name: str) -> Path:
    path = BIN_DIR / name
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: build it first (cargo build --bins), or set TESSERA_BIN_DIR"
        )
    return path


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    """Polls ``predicate`` until it returns a true value (returned) or
    ``timeout`` passes (raises, naming ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


class Cluster:
    """``tessera up`` with n shards x r replica groups and table ``emb``
    (dim 8, SGD with learning rate 0.5), plus the examples' tables
    ``wide`` and ``embeddings``; stopped by :meth:`stop`."""

    TABLE = "emb"
    DIM = 8
    LEARNING_RATE = 0.5
    WIDE = "wide"
    EMBEDDINGS = "embeddings"

    def __init__(
        self,
        workdir: Path,
        transport: str,
        num_shards: int = 2,
        replica_groups: int = 2,
        failover: bool = False,
    ) -> None:
        self.transport = transport
        self.workdir = workdir
        self.run_dir = workdir / "run"
        config = workdir / "cluster.toml"
        text = (
            f"num_shards = {num_shards}\nreplica_groups = {replica_groups}\n"
            "worker_connect_timeout_ms = 1000\nworker_request_timeout_ms = 1000\n"
            "worker_call_timeout_ms = 3000\n"
        )
        if failover:
            text += "local_etcd = true\n"
        text += TRANSPORTS[transport]
        text += (
            f'[[tables]]\nname = "{self.TABLE}"\ndim = {self.DIM}\n'
            f'optimizer = {{ kind = "sgd", learning_rate = {self.LEARNING_RATE} }}\n'
            'initializer = { kind = "uniform", scale = 0.5 }\n'
            # The examples' tables: the logistic regression's weights (one
            # per feature, from zero) and the PyTorch example's embeddings.
            f'[[tables]]\nname = "{self.WIDE}"\ndim = 1\n'
            'optimizer = { kind = "adagrad", learning_rate = 0.2, initial_accumulator = 1e-4 }\n'
            'initializer = { kind = "zeros" }\n'
            f'[[tables]]\nname = "{self.EMBEDDINGS}"\ndim = 16\n'
            'optimizer = { kind = "adagrad", learning_rate = 0.1, initial_accumulator = 1e-4 }\n'
            'initializer = { kind = "normal", std = 0.1 }\n'
        )
        if failover:
            text += '[coordinator]\nkind = "etcd"\nfailover_timeout_ms = 2000\n'
        config.write_text(text)
        self.log = open(workdir / "tessera-up.log", "wb")
        self.process = subprocess.Popen(
            [str(binary("tessera")), "up", "--config", str(config), "--run-dir", str(self.run_dir)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TESSERA_PS_SERVER_BIN": str(binary("ps-server"))},
        )
        try:
            # `tessera up` writes worker.toml (whole, by a rename) once every
            # server answers Health.
            wait_for(self._ready, 90, f"`tessera up` ({self.log.name})")
        except BaseException:
            self.stop()
            raise
        self.worker_config = self.run_dir / "worker.toml"

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"`tessera up` exited with {self.process.returncode}: "
                + Path(self.log.name).read_text(errors="replace")[-2000:]
            )
        return (self.run_dir / "worker.toml").exists()

    def server_address(self, group: int, shard: int) -> str:
        text = (self.run_dir / f"ps-g{group}-s{shard}.toml").read_text()
        match = re.search(r'^listen\s*=\s*"([^"]+)"', text, re.MULTILINE)
        assert match, text
        return match.group(1)

    def server_pid(self, group: int, shard: int) -> int:
        # The whole path: every cluster names its files alike, and a
        # process of another cluster (the session's) must not match.
        config = str(self.run_dir / f"ps-g{group}-s{shard}.toml").encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if config in cmdline and b"--config" in cmdline:
                return int(entry.name)
        raise LookupError(f"no process serves {config.decode()}")

    def kill(self, group: int, shard: int) -> None:
        """SIGKILLs the server of (group, shard)."""
        pid = self.server_pid(group, shard)
        os.kill(pid, signal.SIGKILL)

    def rust(self, *args: str, stdin: Optional[str] = None) -> dict:
        """Runs the Rust worker client (`worker --config worker.toml --table
        emb ARGS`) and returns its JSON output."""
        out = subprocess.run(
            [str(binary("worker")), "--config", str(self.worker_config), "--table", self.TABLE, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(f"worker {' '.join(args)} failed: {out.stderr}")
        return json.loads(out.stdout)

    def rust_fetch(self, keys: List[int]) -> List[List[float]]:
        return self.rust("fetch", "--keys", ",".join(map(str, keys)))["rows"]

    def rust_push(self, keys: List[int], gradients: List[List[float]]) -> int:
        return self.rust("push", "--keys", ",".join(map(str, keys)), stdin=json.dumps(gradients))[
            "push_id"
        ]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class LossyProxy:
    """A TCP proxy to ``upstream`` that, while ``lose`` is above 0, resets
    the connection instead of forwarding what the server sends (the
    server acted on the request; its answer is lost), counting each in
    ``lost``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.address = "%s:%d" % self.listener.getsockname()
        self.lose = 0
        self.lost = 0
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _take_loss(self) -> bool:
        with self.lock:
            if self.lose > 0:
                self.lose -= 1
                self.lost += 1
                return True
            return False

    def _pipe(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_server and self._take_loss():
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                # RST, not FIN: the client sees the connection break.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
