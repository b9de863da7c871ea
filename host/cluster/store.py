"""The cluster store: one Redis reached through redis.asyncio, its key layout, and the
translation of Redis failures into `StoreUnavailable`.

Key layout (prefix `aenv:` by default; README.md draws it with the writers of each key):

    <p>nodes                      SET    ids of the nodes that ever heartbeated
    <p>node:<id>                  HASH   address, capacity, usage, state, lastHeartbeatMs, ...
    <p>node:<id>:alive            STRING set by every heartbeat, expires after the dead bound
    <p>node:<id>:sandboxes        SET    ids of the sandboxes bound to the node
    <p>node:<id>:placing          ZSET   placements not yet created (member: placement id,
                                         score: expiry in Redis ms)
    <p>sandbox:<id>               HASH   node, state (running | paused | lost), lostAtMs
    <p>rr                         STRING round-robin turn counter

The Lua scripts (scripts.py) build the same keys from the prefix; `Keys` is the one
Python spelling of them. One Redis (or a Sentinel-managed primary), not Redis Cluster:
the scripts touch keys they compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from . import scripts
from .errors import StoreUnavailable

DEFAULT_PREFIX = "aenv:"
# node ids are parts of key names and URLs: no ':' or '/'
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @property
    def nodes(self) -> str:
        return f"{self.prefix}nodes"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def alive(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}:alive"

    def node_sandboxes(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}:sandboxes"

    def node_layers(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}:layers"

    def node_memory(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}:memory"

    def placing(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}:placing"

    def sandbox(self, sandbox_id: str) -> str:
        return f"{self.prefix}sandbox:{sandbox_id}"

    def moving(self, sandbox_id: str) -> str:
        return f"{self.prefix}sandbox:{sandbox_id}:moving"

    def idempotency(self, key_hash: str) -> str:
        return f"{self.prefix}idempotency:{key_hash}"

    def template(self, ref: str) -> str:
        return f"{self.prefix}template:{ref}"

    @property
    def round_robin(self) -> str:
        return f"{self.prefix}rr"


@contextlib.asynccontextmanager
async def redis_errors(what: str) -> AsyncIterator[None]:
    """Redis failures (connection refused, timeouts, script errors) as StoreUnavailable.

    Also re-raises a cancellation redis.asyncio swallowed: on Python 3.11 its
    `asyncio.wait_for` returns a command's result when the cancellation arrives just as
    the command completes, and the cancelled task would go on running (a heartbeat or
    sweep loop that never stops)."""
    try:
        yield
    except RedisError as exc:
        raise StoreUnavailable(f"the cluster store (Redis) failed while {what}: "
                               f"{exc or type(exc).__name__}") from exc
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class ClusterStore:
    """A Redis client with the cluster's key layout and scripts. `aclose()` when done."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = DEFAULT_PREFIX) -> None:
        self.redis = client
        self.keys = Keys(prefix)
        self.scripts = {name: client.register_script(source)
                        for name, source in scripts.SCRIPTS.items()}

    @classmethod
    def from_url(cls, url: str, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = 5.0) -> ClusterStore:
        """A store for `redis://host:port/db` (or rediss://, unix://); connects lazily."""
        client = aioredis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                   socket_connect_timeout=min(timeout_s, 2.0),
                                   health_check_interval=30)
        return cls(client, prefix=prefix)

    async def run(self, script: str, *args: Any) -> Any:
        """Run one of scripts.SCRIPTS with the prefix as its first argument."""
        async with redis_errors(f"running {script}"):
            return await self.scripts[script](keys=[], args=[self.keys.prefix, *args])

    async def ping(self) -> bool:
        async with redis_errors("pinging"):
            return bool(await self.redis.ping())

    async def aclose(self) -> None:
        await self.redis.aclose()
