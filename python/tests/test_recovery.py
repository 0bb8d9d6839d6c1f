"""Exactly-once Push when answers are lost, and failover the caller does
not notice, through the Python client."""

import threading

import numpy as np
import pytest

import tessera
from support import Cluster, LossyProxy, wait_for

# A retry storm on purpose: every lost answer is retried, the retry budget
# never runs dry.
STORMY = {
    "retry": {"max_attempts": 4},
    "budget": {"max_tokens": 1e9, "reserve_per_sec": 1e9},
}


@pytest.fixture(scope="module")
def unreplicated(tmp_path_factory):
    """2 shards, one server each over TCP: a Push whose answer is lost can
    only be retried on the same server (with replicas, the client may be
    redirected to the primary's own address, around the proxy)."""
    cluster = Cluster(tmp_path_factory.mktemp("unreplicated"), "tcp", replica_groups=1)
    yield cluster
    cluster.stop()


def proxied_client(cluster: Cluster, proxy: LossyProxy, **overrides) -> tessera.Client:
    """A client whose way to shard 0's server runs through ``proxy``;
    shard 1 is reached directly."""
    servers = [
        {"address": proxy.address, "shards": [0], "replica_group": 0},
        {"address": cluster.server_address(0, 1), "shards": [1], "replica_group": 0},
    ]
    config = {
        "num_shards": 2,
        "replica_groups": 1,
        "servers": servers,
        "connect_timeout_ms": 1000,
        "request_timeout_ms": 2000,
        "call_timeout_ms": 10000,
        **STORMY,
    }
    config.update(overrides)
    return tessera.Client(config)


def test_a_push_whose_answers_are_lost_is_applied_once(unreplicated, fresh_keys):
    """Over TCP only: the proxy loses the server's answers on the TCP
    stream (over RDMA they travel through registered memory, which no
    proxy sees; the servers' deduplication is the same for both)."""
    proxy = LossyProxy(unreplicated.server_address(0, 0))
    try:
        client = proxied_client(unreplicated, proxy)
        keys = fresh_keys(30)
        before = client.fetch(Cluster.TABLE, keys)
        grads = np.random.default_rng(7).standard_normal((30, Cluster.DIM)).astype(np.float32)
        pushes = 10
        for _ in range(pushes):
            with proxy.lock:
                proxy.lose = 2
            client.push(Cluster.TABLE, keys, grads)
        assert proxy.lost == 2 * pushes, "every Push lost two answers"
        after = client.fetch(Cluster.TABLE, keys)
        np.testing.assert_allclose(
            after, before - 0.5 * pushes * grads, rtol=1e-5, atol=1e-5,
            err_msg="a Push was applied more (or less) than once",
        )
    finally:
        proxy.close()


def test_a_failed_push_retried_under_its_id_is_applied_once(unreplicated, fresh_keys):
    proxy = LossyProxy(unreplicated.server_address(0, 0))
    try:
        client = proxied_client(unreplicated, proxy, push_timeout_ms=1500)
        keys = fresh_keys(30)
        before = client.fetch(Cluster.TABLE, keys)
        grads = np.ones((30, Cluster.DIM), np.float32)
        with proxy.lock:
            proxy.lose = 10**9  # every answer of shard 0's primary is lost
        with pytest.raises(tessera.PushFailed) as err:
            client.push(Cluster.TABLE, keys, grads)
        failure = err.value
        assert failure.retriable, failure.failed
        assert [(t, s) for t, s, *_ in failure.failed] == [(Cluster.TABLE, 0)]
        assert failure.acknowledged == [(Cluster.TABLE, 1)]
        with proxy.lock:
            proxy.lose = 0
        # The same Push under its id: shard 0 (applied, answers lost) and
        # shard 1 (acknowledged) are not applied again.
        assert client.push(Cluster.TABLE, keys, grads, push_id=failure.push_id) == failure.push_id
        np.testing.assert_allclose(client.fetch(Cluster.TABLE, keys), before - 0.5, rtol=1e-6)
    finally:
        proxy.close()


def train(client: tessera.Client, keys, steps: int, on_step, errors: list) -> None:
    grads = np.full((len(keys), Cluster.DIM), 0.01, np.float32)
    for step in range(steps):
        try:
            client.fetch(Cluster.TABLE, keys)
            client.push(Cluster.TABLE, keys, grads)
        except tessera.TesseraError as e:
            errors.append((step, e))
        on_step(step)


def expect_every_push_applied_once(client, keys, before, steps):
    """Reads until a Fetch shows every Push (a replica may answer an instant
    before it applies the last one), then checks no Push counted twice."""
    expected = before - 0.5 * 0.01 * steps
    wait_for(
        lambda: np.allclose(client.fetch(Cluster.TABLE, keys), expected, rtol=1e-4, atol=1e-5),
        10,
        "a Fetch that shows every Push",
    )
    np.testing.assert_allclose(client.fetch(Cluster.TABLE, keys), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transport", ["tcp", "rdma-soft"])
def test_a_dead_replica_is_failed_over_without_the_caller_noticing(tmp_path, transport, fresh_keys):
    """SIGKILL a replica of shard 0 (group 1; shard 0's primary is group 0)
    while a trainer fetches and pushes: no call fails, every Push counts."""
    cluster = Cluster(tmp_path, transport)
    try:
        client = tessera.Client(cluster.worker_config)
        keys = fresh_keys(64)
        before = client.fetch(Cluster.TABLE, keys)
        steps, kill_at = 200, 40
        errors: list = []
        killed = threading.Event()

        def on_step(step):
            if step == kill_at:
                cluster.kill(1, 0)
                killed.set()

        train(client, keys, steps, on_step, errors)
        assert killed.is_set()
        assert not errors, errors[:3]
        expect_every_push_applied_once(client, keys, before, steps)
    finally:
        cluster.stop()


def test_a_dead_primary_is_failed_over_without_the_caller_noticing(tmp_path, fresh_keys):
    """With etcd leases: SIGKILL shard 0's primary under a trainer; its
    Pushes wait out the failover and go on at the promoted replica."""
    cluster = Cluster(tmp_path, "tcp", failover=True)
    try:
        client = tessera.Client(cluster.worker_config)
        keys = fresh_keys(64)
        before = client.fetch(Cluster.TABLE, keys)
        first_primary = client.primary(0)
        steps, kill_at = 120, 30
        errors: list = []

        def on_step(step):
            if step == kill_at:
                cluster.kill(0, 0)

        train(client, keys, steps, on_step, errors)
        assert not errors, errors[:3]
        assert client.primary(0) != first_primary, "shard 0 has a new primary"
        expect_every_push_applied_once(client, keys, before, steps)
    finally:
        cluster.stop()
