"""The Python client against a local cluster over tcp and rdma-soft:
numerics against the Rust worker client, arrays in and out, errors, threads
and asyncio."""

import asyncio
import threading

import numpy as np
import pytest

import tessera
from support import Cluster, wait_for


def settle(predicate, what):
    """Reads until ``predicate`` holds: a Fetch right after a Push may be
    answered by a replica that applies the Push's stream an instant after
    the primary acknowledged it (replicas are not read-your-writes)."""
    wait_for(predicate, 10, what)


def test_fetch_and_push_match_the_rust_client(cluster, client, fresh_keys):
    # Keys over both shards, one repeated.
    keys = fresh_keys(40)
    keys.append(keys[3])
    dim, lr = Cluster.DIM, np.float32(Cluster.LEARNING_RATE)

    before = client.fetch(Cluster.TABLE, keys)
    assert before.shape == (len(keys), dim) and before.dtype == np.float32
    rust_before = np.asarray(cluster.rust_fetch(keys), dtype=np.float32)
    np.testing.assert_array_equal(before, rust_before)
    np.testing.assert_array_equal(before[3], before[-1])

    # Python pushes; the Rust client reads what the Python one does. The
    # repeated key's gradients are summed.
    grads = np.arange(len(keys) * dim, dtype=np.float32).reshape(len(keys), dim) / 100
    client.push(Cluster.TABLE, keys, grads)
    summed = grads.copy()
    summed[3] += grads[-1]
    summed[-1] = summed[3]
    expected = before - lr * summed
    # A Fetch may be answered by a replica that applies the Push's stream
    # an instant after the primary acknowledged it: wait until both
    # clients read the Push from whichever replica they ask.
    def settled():
        after = client.fetch(Cluster.TABLE, keys)
        rust = np.asarray(cluster.rust_fetch(keys), dtype=np.float32)
        if np.allclose(after, expected, rtol=1e-6, atol=1e-7) and np.array_equal(after, rust):
            return (after,)
        return None

    (after,) = wait_for(settled, 10, "both clients to read the Push")

    # The Rust client pushes; the Python one reads it.
    rust_grads = [[1.0 + i] * dim for i in range(len(keys) - 1)]
    cluster.rust_push(keys[:-1], rust_grads)
    expected = after[:-1] - lr * np.asarray(rust_grads, dtype=np.float32)
    wait_for(
        lambda: np.allclose(client.fetch(Cluster.TABLE, keys[:-1]), expected, rtol=1e-6, atol=1e-7),
        10,
        "the Python client to read the Rust client's Push",
    )


def test_fetch_many_and_push_many_cover_several_specs(client, fresh_keys):
    a, b = fresh_keys(5), fresh_keys(7)
    rows_a, rows_b = client.fetch_many([(Cluster.TABLE, a), (Cluster.TABLE, b)])
    assert rows_a.shape == (5, Cluster.DIM) and rows_b.shape == (7, Cluster.DIM)
    ones_a = np.ones((5, Cluster.DIM), np.float32)
    ones_b = np.ones((7, Cluster.DIM), np.float32)
    client.push_many([(Cluster.TABLE, a, ones_a), (Cluster.TABLE, b, ones_b)])

    def applied():
        after_a, after_b = client.fetch_many([(Cluster.TABLE, a), (Cluster.TABLE, b)])
        return np.allclose(after_a, rows_a - 0.5, rtol=1e-6) and np.allclose(
            after_b, rows_b - 0.5, rtol=1e-6
        )

    settle(applied, "fetch_many to read push_many")


def test_rows_are_copied_once_into_an_array_numpy_does_not_copy_again(client, fresh_keys):
    """The documented one copy: the merged row block is the array's buffer
    (its base is the Rust allocation, not another NumPy array), and keys
    that are already a contiguous uint64 array are read in place."""
    keys = np.array(fresh_keys(16), dtype=np.uint64)
    rows = client.fetch(Cluster.TABLE, keys)
    assert rows.flags.c_contiguous and rows.flags.writeable and rows.flags.aligned
    assert rows.base is not None and not isinstance(rows.base, np.ndarray)
    assert type(rows.base).__name__ == "PySliceContainer", type(rows.base)
    # Each Fetch has a block of its own: writing to one does not reach the
    # server or the next Fetch.
    again = client.fetch(Cluster.TABLE, keys)
    assert not np.shares_memory(rows, again)
    rows[:] = 42.0
    assert not (client.fetch(Cluster.TABLE, keys) == 42.0).any()

    from tessera._client import _gradients, _keys

    assert _keys(keys) is keys, "a contiguous uint64 array is read in place"
    converted = _keys([1, 2, 3])
    assert converted.dtype == np.uint64 and list(converted) == [1, 2, 3]
    assert _keys(keys[::2]) is not keys  # a strided view: one contiguous copy
    grads = np.ones((16, Cluster.DIM), np.float32)
    assert _gradients(grads, 16) is grads, "C-contiguous float32 is read in place"
    assert _gradients(np.ones((16, Cluster.DIM)), 16).dtype == np.float32


def test_keys_of_any_integer_dtype_give_the_same_rows(client, fresh_keys):
    keys = fresh_keys(6)
    expected = client.fetch(Cluster.TABLE, np.array(keys, dtype=np.uint64))
    for variant in (keys, tuple(keys), np.array(keys, np.int64), np.array(keys, np.int32),
                    np.array(keys, np.uint32)):
        np.testing.assert_array_equal(client.fetch(Cluster.TABLE, variant), expected)


def test_errors_are_exceptions_with_a_code(cluster, client, fresh_keys):
    keys = fresh_keys(3)
    with pytest.raises(tessera.NotFound) as err:
        client.fetch("no_such_table", keys)
    assert err.value.code == "NOT_FOUND" and "no_such_table" in err.value.message
    assert isinstance(err.value, LookupError) and isinstance(err.value, tessera.TesseraError)

    for bad in ([-1, 2], [1.5, 2.0], [[1, 2]], ["a"]):
        with pytest.raises(tessera.InvalidArgument) as err:
            client.fetch(Cluster.TABLE, bad)
        assert err.value.code == "INVALID_ARGUMENT"
        assert isinstance(err.value, ValueError)

    with pytest.raises(tessera.InvalidArgument, match=r"shape \(3, dim\)"):
        client.push(Cluster.TABLE, keys, np.ones((2, Cluster.DIM), np.float32))

    # A gradient row of the wrong length: the servers refuse it, every part
    # fails, and the failure is not worth retrying.
    with pytest.raises(tessera.PushFailed) as err:
        client.push(Cluster.TABLE, keys, np.ones((3, Cluster.DIM + 1), np.float32))
    assert err.value.code == "INVALID_ARGUMENT" and not err.value.retriable
    assert err.value.failed and err.value.push_id > 0

    with pytest.raises(tessera.InvalidArgument, match="no_such_key"):
        tessera.Client(cluster.worker_config, no_such_key=1)
    with pytest.raises(tessera.InvalidArgument, match="num_shards"):
        tessera.Client(cluster.worker_config, num_shards=0)
    with pytest.raises(TypeError):
        tessera.Client(42)


def test_a_server_nobody_listens_on_is_unavailable(cluster, fresh_keys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = "127.0.0.1:%d" % s.getsockname()[1]
    client = tessera.Client(
        {
            "num_shards": 1,
            "servers": [{"address": dead, "shards": [0], "replica_group": 0}],
            "connect_timeout_ms": 200,
            "request_timeout_ms": 200,
            "call_timeout_ms": 600,
        }
    )
    with pytest.raises((tessera.Unavailable, tessera.DeadlineExceeded)) as err:
        client.fetch(Cluster.TABLE, fresh_keys(2))
    assert err.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert dead in err.value.message


def test_threads_run_calls_concurrently(client, fresh_keys):
    """Eight threads fetch and push at once. The interpreter lock is let go
    while a call waits: another thread enters a call while one is inside
    (with the lock held throughout, at most one would ever be)."""
    threads, steps = 8, 30
    keys = [fresh_keys(20) for _ in range(threads)]
    before = [client.fetch(Cluster.TABLE, k) for k in keys]
    inside, most = [0], [0]
    lock = threading.Lock()
    errors = []

    def work(i):
        try:
            grads = np.full((20, Cluster.DIM), 0.01, np.float32)
            for _ in range(steps):
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                client.fetch(Cluster.TABLE, keys[i])
                client.push(Cluster.TABLE, keys[i], grads)
                with lock:
                    inside[0] -= 1
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    assert most[0] > 1, "no two calls were ever in flight together"
    for k, b in zip(keys, before):
        settle(
            lambda: np.allclose(
                client.fetch(Cluster.TABLE, k), b - 0.5 * 0.01 * steps, rtol=1e-5, atol=1e-6
            ),
            "every thread's Pushes to be read",
        )


def test_asyncio_calls_share_the_runtime(cluster, client, fresh_keys):
    keys = [fresh_keys(10) for _ in range(20)]

    async def main():
        aio = client.aio
        rows = await asyncio.gather(*(aio.fetch(Cluster.TABLE, k) for k in keys))
        ones = np.ones((10, Cluster.DIM), np.float32)
        ids = await asyncio.gather(*(aio.push(Cluster.TABLE, k, ones) for k in keys))
        assert len(set(ids)) == len(ids)
        # A replica may answer an instant before it applies the Pushes'
        # stream: read until every row shows its Push.
        for _ in range(200):
            after = await aio.fetch_many([(Cluster.TABLE, k) for k in keys])
            if all(np.allclose(a, r - 0.5, rtol=1e-6) for r, a in zip(rows, after)):
                break
            await asyncio.sleep(0.05)
        with pytest.raises(tessera.NotFound):
            await aio.fetch("no_such_table", keys[0])
        # A client of its own, made for asyncio.
        other = tessera.AsyncClient(cluster.worker_config)
        same = await other.fetch(Cluster.TABLE, keys[0])
        await other.push_many([(Cluster.TABLE, keys[0], ones)])
        return rows, after, same

    rows, after, same = asyncio.run(main())
    for r, a in zip(rows, after):
        np.testing.assert_allclose(a, r - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(same, after[0])
    settle(
        lambda: np.allclose(client.fetch(Cluster.TABLE, keys[0]), rows[0] - 1.0, rtol=1e-6),
        "the AsyncClient's Push to be read",
    )


def test_health_names_every_server(cluster, client):
    health = client.health()
    assert len(health) == 4
    # The client's own connections use the cluster's transport (no silent
    # fallback to TCP on rdma-soft).
    client.fetch(Cluster.TABLE, list(range(64)))
    want = "tcp" if cluster.transport == "tcp" else "rdma"
    for shard in range(client.num_shards):
        used = {t for t in client.transports(shard).values() if t is not None}
        assert used == {want}, (shard, client.transports(shard))
    for address, answer in health.items():
        assert answer["serving"], (address, answer)
        assert answer["tables"][Cluster.TABLE]["dim"] == Cluster.DIM
        assert answer["transport"] == ("tcp" if cluster.transport == "tcp" else "rdma")
