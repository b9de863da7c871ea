"""The cluster index over the store: the node registry (capacity, usage, liveness) and the
sandbox -> node bindings, read as frozen values and changed only through scripts.py.

A node is `dead` as soon as its liveness key has expired, whether or not the scheduler's
sweep has recorded it yet, so readers never route to a node that stopped heartbeating.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .store import ClusterStore, redis_errors


class NodeState(str, enum.Enum):
    READY = "ready"          # heartbeating, takes new sandboxes
    DRAINING = "draining"    # heartbeating, serves its sandboxes, takes no new ones
    DEAD = "dead"            # missed its heartbeats


class BindingState(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    LOST = "lost"            # was running on a node that died


def _int(raw: str | None, default: int = 0) -> int:
    try:
        return int(float(raw)) if raw not in (None, "") else default
    except ValueError:
        return default


def _float(raw: str | None) -> float:
    try:
        return float(raw) if raw not in (None, "") else 0.0
    except ValueError:
        return 0.0


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    """What the registry knows of one node (times in unix seconds)."""

    node_id: str
    address: str                 # its REST API, e.g. http://10.0.0.5:3000
    proxy_address: str           # its sandbox proxy, e.g. http://10.0.0.5:3001
    state: NodeState
    cpu_count: int
    memory_mib: int
    max_sandboxes: int           # 0: no fixed limit
    reserve_mib: int             # memory the node keeps free (its admission refuses below)
    available_mib: int
    used_memory_mib: int
    used_sandboxes: int          # sandboxes holding a VM
    load: float                  # 1-minute load average
    sandboxes: int               # sandboxes bound to it (any state)
    pending: int                 # placements on it not created yet
    last_heartbeat: float
    dead_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.state is not NodeState.DEAD

    @classmethod
    def from_redis(cls, node_id: str, h: Mapping[str, str], *, alive: bool, sandboxes: int,
                   pending: int) -> NodeRecord:
        state = h.get("state", "ready")
        if not alive or state not in (NodeState.READY.value, NodeState.DRAINING.value):
            state = NodeState.DEAD.value
        dead_ms = _int(h.get("deadAtMs"))
        return cls(node_id=node_id, address=h.get("address", ""),
                   proxy_address=h.get("proxyAddress", ""), state=NodeState(state),
                   cpu_count=_int(h.get("cpuCount"), 1), memory_mib=_int(h.get("memoryMiB")),
                   max_sandboxes=_int(h.get("maxSandboxes")),
                   reserve_mib=_int(h.get("reserveMiB")),
                   available_mib=_int(h.get("availableMiB")),
                   used_memory_mib=_int(h.get("usedMemoryMiB")),
                   used_sandboxes=_int(h.get("usedSandboxes")), load=_float(h.get("load")),
                   sandboxes=sandboxes, pending=pending,
                   last_heartbeat=_int(h.get("lastHeartbeatMs")) / 1000,
                   dead_at=dead_ms / 1000 if dead_ms else None)


@dataclass(frozen=True)
class Binding:
    sandbox_id: str
    node_id: str
    state: BindingState
    lost_at: float | None = None


@dataclass(frozen=True)
class Published:
    """A heartbeat's answer: accepted (falsy: a delta was refused), and the paused
    sandboxes it reported that another node holds now (the node forgets them)."""

    accepted: bool
    disowned: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.accepted


class Registry:
    """Reads and changes of the cluster index (one per process; shares the store)."""

    def __init__(self, store: ClusterStore) -> None:
        self.store = store
        self.keys = store.keys

    # --- nodes ---------------------------------------------------------------------------

    async def node_ids(self) -> list[str]:
        async with redis_errors("listing nodes"):
            return sorted(str(m) for m in await self.store.redis.smembers(self.keys.nodes))

    async def nodes(self) -> list[NodeRecord]:
        """Every node whose record exists, dead ones included, ordered by id."""
        return [n for n in await self._read(await self.node_ids()) if n is not None]

    async def live_nodes(self, *, exclude: str | None = None) -> list[NodeRecord]:
        """The nodes alive now (heartbeating), ordered by id; `exclude`: but that one."""
        return [n for n in await self.nodes() if n.alive and n.node_id != exclude]

    async def node(self, node_id: str) -> NodeRecord | None:
        return (await self._read([node_id]))[0]

    async def _read(self, ids: Sequence[str]) -> list[NodeRecord | None]:
        if not ids:
            return []
        k = self.keys
        async with redis_errors("reading nodes"):
            pipe = self.store.redis.pipeline(transaction=False)
            pipe.time()
            for nid in ids:
                pipe.hgetall(k.node(nid))
                pipe.exists(k.alive(nid))
                pipe.scard(k.node_sandboxes(nid))
                pipe.zrange(k.placing(nid), 0, -1, withscores=True)
            res = await pipe.execute()
        sec, usec = res[0]
        now_ms = int(sec) * 1000 + int(usec) // 1000
        out: list[NodeRecord | None] = []
        for i, nid in enumerate(ids):
            h, alive, count, placing = res[1 + 4 * i: 5 + 4 * i]
            if not h or "address" not in h:
                out.append(None)
                continue
            pending = sum(1 for _, expiry in placing if expiry > now_ms)
            out.append(NodeRecord.from_redis(nid, h, alive=bool(alive), sandboxes=int(count),
                                             pending=pending))
        return out

    async def node_sandboxes(self, node_id: str) -> dict[str, Binding]:
        """The bindings naming `node_id` (sandboxes it holds or held when it died)."""
        async with redis_errors("reading a node's sandboxes"):
            members = await self.store.redis.smembers(self.keys.node_sandboxes(node_id))
            sids = sorted(str(m) for m in members)
            pipe = self.store.redis.pipeline(transaction=False)
            for sid in sids:
                pipe.hgetall(self.keys.sandbox(sid))
            hashes = await pipe.execute() if sids else []
        out: dict[str, Binding] = {}
        for sid, h in zip(sids, hashes, strict=True):
            b = self._binding(sid, h)
            if b is not None and b.node_id == node_id:
                out[sid] = b
        return out

    # --- heartbeats and death ------------------------------------------------------------

    async def publish(self, node_id: str, fields: Mapping[str, object], *, alive_ms: int,
                      full: bool, token: str, upserts: Mapping[str, str],
                      removals: Sequence[str] = ()) -> Published:
        """One heartbeat (scripts.HEARTBEAT); falsy: a delta was refused, send it all."""
        done = await self.store.run("heartbeat", node_id, alive_ms,
                                    "full" if full else "delta", token, json.dumps(fields),
                                    json.dumps(dict(upserts)), json.dumps(list(removals)))
        return Published(bool(int(done[0])), tuple(str(x) for x in done[1:]))

    async def sweep(self, *, retention_ms: int) -> dict[str, int]:
        """Declare the nodes whose heartbeats stopped dead: {node id: sandboxes lost}."""
        flat = await self.store.run("sweep", retention_ms)
        return {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    # --- placements ----------------------------------------------------------------------

    async def reserve(self, node_id: str, placement_id: str, *, ttl_ms: int) -> bool:
        return bool(await self.store.run("reserve", node_id, placement_id, ttl_ms))

    async def release(self, node_id: str, placement_id: str) -> None:
        async with redis_errors("releasing a placement"):
            await self.store.redis.zrem(self.keys.placing(node_id), placement_id)

    async def claim_move(self, sandbox_id: str, owner: str, *, ttl_ms: int) -> bool:
        """Hold the right to move `sandbox_id` to another node (one mover at a time, for at
        most `ttl_ms`: a gateway that dies while moving frees it by expiry)."""
        async with redis_errors("claiming a sandbox move"):
            return bool(await self.store.redis.set(self.keys.moving(sandbox_id), owner,
                                                   nx=True, px=ttl_ms))

    async def end_move(self, sandbox_id: str, owner: str) -> None:
        async with redis_errors("ending a sandbox move"):
            await self._delete_if(self.keys.moving(sandbox_id), owner)

    async def _delete_if(self, key: str, value: str) -> None:
        """Delete a claim `key` while it still holds `value` (ours, not a later one's)."""
        if await self.store.redis.get(key) == value:
            await self.store.redis.delete(key)

    # --- memory files nodes hold, for their neighbours (--p2p, host/cluster/peers.py) ----

    async def announce_memory(self, node_id: str, owners: Sequence[str]) -> None:
        if owners:
            async with redis_errors("announcing memory files"):
                await self.store.redis.sadd(self.keys.node_memory(node_id), *owners)

    async def withdraw_memory(self, node_id: str, owners: Sequence[str]) -> None:
        if owners:
            async with redis_errors("withdrawing memory files"):
                await self.store.redis.srem(self.keys.node_memory(node_id), *owners)

    async def memory_holders(self, owner: str, node_ids: Sequence[str]) -> list[str]:
        """Those of `node_ids` that announced the memory of snapshot `owner`."""
        async with redis_errors("finding memory files"):
            pipe = self.store.redis.pipeline(transaction=False)
            for node_id in node_ids:
                pipe.sismember(self.keys.node_memory(node_id), owner)
            found = await pipe.execute()
        return [n for n, has in zip(node_ids, found, strict=True) if has]

    async def set_layers(self, node_id: str, layers: Sequence[str]) -> None:
        """The layers (sha256 hex) the node holds bytes of, replacing what it said before."""
        async with redis_errors("announcing layers"):
            pipe = self.store.redis.pipeline(transaction=True)
            pipe.delete(self.keys.node_layers(node_id))
            if layers:
                pipe.sadd(self.keys.node_layers(node_id), *layers)
            await pipe.execute()

    async def layers_of(self, node_ids: Sequence[str]) -> dict[str, set[str]]:
        async with redis_errors("reading the nodes' layers"):
            pipe = self.store.redis.pipeline(transaction=False)
            for node_id in node_ids:
                pipe.smembers(self.keys.node_layers(node_id))
            found = await pipe.execute()
        return {n: {str(x) for x in got} for n, got in zip(node_ids, found, strict=True)}

    # --- creates' Idempotency-Keys: the node that makes the sandbox of each key ---------

    def _idempotency(self, key: str) -> str:
        return self.keys.idempotency(hashlib.sha256(key.encode()).hexdigest())

    async def claim_idempotency(self, key: str, node_id: str, *, ttl_ms: int) -> str:
        """The node that creates the sandbox of this Idempotency-Key: `node_id` when no
        create claimed the key before, else the earlier claim's node (atomic: SET NX GET)."""
        async with redis_errors("claiming an idempotency key"):
            old = await self.store.redis.set(self._idempotency(key), node_id, nx=True,
                                             get=True, px=ttl_ms)
        return str(old) if old else node_id

    async def release_idempotency(self, key: str, node_id: str) -> None:
        """Forget `node_id`'s claim of the key (its create never reached the node)."""
        async with redis_errors("releasing an idempotency key"):
            await self._delete_if(self._idempotency(key), node_id)

    # --- templates: which node built one (a hint; gateway/templates.py) -----------------

    async def template_home(self, ref: str) -> str | None:
        """The node that built the template `ref` (an id or a name), as last seen."""
        async with redis_errors("reading a template's node"):
            node = await self.store.redis.get(self.keys.template(ref))
        return str(node) if node else None

    async def set_template_home(self, refs: Sequence[str], node_id: str) -> None:
        async with redis_errors("recording a template's node"):
            await self.store.redis.mset({self.keys.template(r): node_id for r in refs})

    async def next_turn(self) -> int:
        async with redis_errors("taking a round-robin turn"):
            return int(await self.store.redis.incr(self.keys.round_robin))

    # --- bindings ------------------------------------------------------------------------

    def _binding(self, sid: str, h: Mapping[str, str]) -> Binding | None:
        try:
            state = BindingState(h.get("state", ""))
        except ValueError:
            return None
        if not h.get("node"):
            return None
        lost = _int(h.get("lostAtMs"))
        return Binding(sid, h["node"], state, lost / 1000 if lost else None)

    async def binding(self, sandbox_id: str) -> Binding | None:
        async with redis_errors("reading a binding"):
            h = await self.store.redis.hgetall(self.keys.sandbox(sandbox_id))
        return self._binding(sandbox_id, {str(k): str(v) for k, v in h.items()})

    async def bind(self, sandbox_id: str, node_id: str, state: BindingState, *,
                   placement_id: str | None = None, used_delta: int = 0) -> None:
        """Bind (or move) a sandbox to a node; releases its placement and counts it in the
        node's usage until the node's next heartbeat says how many it really runs."""
        await self.store.run("bind", sandbox_id, node_id, state.value, placement_id or "",
                             used_delta)

    async def unbind(self, sandbox_id: str, node_id: str) -> None:
        await self.store.run("unbind", sandbox_id, node_id)

    async def set_state(self, sandbox_id: str, node_id: str, state: BindingState) -> bool:
        return bool(await self.store.run("set_state", sandbox_id, node_id, state.value))
