"""Fixtures of the cluster tests: one private redis-server for the session (loopback, no
persistence, killed at the end), an envd process, and whole clusters (harness.py) on
loopback ports, each starting from an empty Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.proxy.conftest import envd_port  # noqa: F401 - the session's envd process

from .harness import Cluster, RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """The session's Redis, emptied for this test."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    yield redis_server.url


@pytest.fixture
def make_cluster(redis_url: str, tmp_path, envd_port: int):  # noqa: F811
    """make_cluster(nodes=3, max_sandboxes=0, strategy=...) -> a started Cluster."""
    made: list[Cluster] = []

    def make(**kwargs) -> Cluster:
        cluster = Cluster(redis_url, tmp_path / f"cluster{len(made)}", envd_port, **kwargs)
        made.append(cluster)
        return cluster.start()

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def cluster(make_cluster) -> Cluster:
    """Three nodes, the scheduler and the gateway."""
    return make_cluster()
