"""Collecting layers in a repository other nodes share: holdings and two phases.

A node deletes the repository copies of the layers it made itself only (those in its own
layers dir: sealed, imported or merged here); another node's objects are never its to
delete (`BlockServer.collect(repository="own")`). Documents name what every node needs
(`collect.py`'s roots), but in a shared repository a layer no document names may still be
read by another node's stack, or be about to be stacked by a start there that read a
manifest deleted since. So:

- each node publishes what it holds, `gcheld-<node>` {node, updated_at, layers}: its
  stacks' layers and its starts' pins, every `PUBLISH_S` (an owned runtime task) and at
  each collection; as a document, it is a root like any other;
- a layer found unreferenced is remembered (`gc-pending.json`, first seen when) and goes
  only once every other node's holdings were published after that (whatever a start
  there had read before is pinned or stacked, and so in them) and it is still
  unreferenced;
- holdings not rewritten for `node_expiry_s` are a node that is gone: not waited for,
  not a root.

Holdings also list what the node made (`made`: its layers dir; `memory`: its upload
ledger), so what it put in the repository is never nobody's:
- a node gone leaves them to the live node first by id, which deletes those nothing needs
  (two phases, as its own) and rewrites the gone node's holdings without them; once they
  name nothing, they go too;
- a node that lost its state dir (or collected after its last holdings) reads its last
  holdings at its first publish: what they list and it no longer has is still its own
  (`NodeParts.lost`), deleted from the repository by its collections once unused.

A node alone on a non-default repository (an `oss` bucket of its own) has no other
holdings to wait for: what it finds unreferenced goes at once, as on its own posix_fs one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from host.durable import write_atomic
from host.storage.collect import Swept, layer_hex
from host.storage.errors import RepositoryError

from .memory import MEMORY_KEY
from .parts import Claims, NodeParts

log = logging.getLogger(__name__)

PREFIX = "gcheld-"
PUBLISH_S = 60.0


def _made(p: NodeParts) -> tuple[set[str], set[str]]:
    """The layers (hex) and memory (snapshot ids) this node has a record of making."""
    layers = {f.name[:-5] for f in p.config.layers_dir.glob("*.lsmt")}
    return layers, p.memory.owned()


async def publish(p: NodeParts) -> None:
    """Write this node's holdings as of the time they carry (taken before they are read:
    whatever was held then is in them)."""
    now = time.time()
    stacks = await p.block.client.list()
    held = {d for info in stacks for d in info.layers} | set(p.layer_pins)
    layers, memory = await asyncio.to_thread(_made, p)
    name = PREFIX + p.config.node_id
    if p.lost is None:  # this run's first: what an earlier one made and we lack is ours
        last = await p.manifests.get_doc(name) or {}
        p.lost = Claims(layers=set(_strings(last, "made")) - layers,
                        memory=set(_strings(last, "memory")) - memory)
        if p.lost.layers or p.lost.memory:
            log.info("%d layers and %d memory dirs in the repository were this node's "
                     "before it lost them; collections delete those unused",
                     len(p.lost.layers), len(p.lost.memory))
    await p.manifests.put_doc(name, {
        "node": p.config.node_id, "updated_at": now, "layers": sorted(held),
        "made": sorted(layers | p.lost.layers), "memory": sorted(memory | p.lost.memory)})


def _strings(doc: dict[str, Any], key: str) -> list[str]:
    value = doc.get(key)
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def others(p: NodeParts, docs: dict[str, dict[str, Any]],
           now: float) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Drop from `docs` the holdings of nodes gone (older than `node_expiry_s`); returns
    when each other node still there last published its own, and the gone ones'
    holdings by node."""
    out: dict[str, float] = {}
    gone: dict[str, dict[str, Any]] = {}
    for name, doc in list(docs.items()):
        if not name.startswith(PREFIX) or name == PREFIX + p.config.node_id:
            continue
        try:
            at = float(doc["updated_at"])
        except (KeyError, TypeError, ValueError):
            at = 0.0
        if now - at > p.config.node_expiry_s:
            gone[name[len(PREFIX):]] = docs.pop(name)  # neither a root nor waited for
        else:
            out[name[len(PREFIX):]] = at
    return out, gone


def orphans(p: NodeParts, gone: dict[str, dict[str, Any]], peers: dict[str, float],
            keep: set[str]) -> tuple[Claims, dict[str, dict[str, Any]]]:
    """The repository's layers and memory no live node but this one has a record of: its
    own lost ones and, when it is the live node first by id, what gone nodes made (their
    holdings, adopted, are returned too). Layers `keep` (digests) names are left out;
    memory is checked against the manifests by the caller."""
    out = Claims(set(p.lost.layers), set(p.lost.memory)) if p.lost else Claims()
    adopted = gone if gone and p.config.node_id == min([p.config.node_id, *peers]) else {}
    for doc in adopted.values():
        out.layers |= set(_strings(doc, "made"))
        out.memory |= set(_strings(doc, "memory"))
    out.layers -= {layer_hex(d) for d in keep}
    return out, adopted


async def delete_orphans(p: NodeParts, found: Claims, layers: set[str], used: set[str],
                         adopted: dict[str, dict[str, Any]], *,
                         dry_run: bool) -> tuple[Swept, Swept]:
    """Delete from the repository the orphan `layers` (hex, past their phase) and the
    orphan memory (`found.memory`) no manifest or start `used`; forget them (adopted
    holdings are rewritten without them, and deleted once they list nothing). Returns
    what went (`dry_run`: would go, bytes uncounted): (layers, memory)."""
    repo = p.manifests.repo
    swept_layers, swept_memory = Swept(), Swept()

    async def gone(swept: Swept, name: str, delete: Callable[[str], int], key: str) -> bool:
        try:
            swept.add_bytes(name, 0 if dry_run else await asyncio.to_thread(delete, key))
            return True
        except (RepositoryError, OSError) as exc:  # kept, and tried again next time
            log.warning("deleting %s from the repository: %s", key, exc)
            return False

    layers = {h for h in sorted(layers)
              if await gone(swept_layers, h, repo.delete_layer, f"sha256:{h}")}
    memory = {o for o in sorted(found.memory - used)
              if await gone(swept_memory, o, repo.delete_files, MEMORY_KEY + o)}
    if dry_run:
        return swept_layers, swept_memory
    if p.lost is not None:
        p.lost.layers -= layers
        p.lost.memory -= memory
    for node, doc in adopted.items():
        made = [h for h in _strings(doc, "made") if h not in layers]
        mem = [o for o in _strings(doc, "memory") if o not in memory]
        if made or mem:
            if (made, mem) != (_strings(doc, "made"), _strings(doc, "memory")):
                await p.manifests.put_doc(PREFIX + node, {**doc, "made": made, "memory": mem})
        else:
            await p.manifests.delete_doc(PREFIX + node)
    return swept_layers, swept_memory


def ready(p: NodeParts, candidates: list[str], peers: dict[str, float],
          now: float, *, remember: bool = True) -> set[str]:
    """Of the layers unreferenced now (`candidates`, hex), those that may go: found
    unreferenced before every other node's last holdings. Remembers the rest (not on a
    dry run: `remember` False)."""
    path = p.config.state_dir / "gc-pending.json"
    try:
        pending: dict[str, float] = json.loads(path.read_text())
    except (OSError, ValueError):
        pending = {}
    pending = {h: float(pending.get(h, now)) for h in map(layer_hex, candidates)}
    # nodes' clocks may differ: a holdings' time counts from that much earlier
    horizon = min(peers.values(), default=float("inf")) - p.config.node_clock_skew_s
    out = {h for h, first in pending.items() if first < horizon}
    left = {h: t for h, t in pending.items() if h not in out}
    if not remember:
        return out
    write_atomic(path, json.dumps(left).encode())
    if left:
        log.info("%d unreferenced layers wait for %d other nodes' holdings", len(left),
                 len(peers))
    return out
