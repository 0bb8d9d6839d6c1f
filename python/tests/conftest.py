"""Fixtures: one `tessera up` cluster per transport for the whole session
(tests use keys of their own so that they do not disturb each other), and
a fresh cluster for tests that kill servers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from support import Cluster  # noqa: E402

import tessera  # noqa: E402

TRANSPORT_IDS = ["tcp", "rdma-soft"]


@pytest.fixture(scope="session", params=TRANSPORT_IDS)
def cluster(request, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp(f"cluster-{request.param}"), request.param)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def tcp_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster-tcp-only"), "tcp")
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    return tessera.Client(cluster.worker_config)


class Keys:
    """Hands each test keys no other test uses."""

    next = 1_000

    @classmethod
    def take(cls, n: int):
        start = cls.next
        cls.next += n + 1_000
        return list(range(start, start + n))


@pytest.fixture
def fresh_keys():
    return Keys.take
