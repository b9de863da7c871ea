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

A node alone on a non-default repository (an `oss` bucket of its own) has no other
holdings to wait for: what it finds unreferenced goes at once, as on its own posix_fs one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from host.storage.collect import layer_hex

from .parts import NodeParts

log = logging.getLogger(__name__)

PREFIX = "gcheld-"
PUBLISH_S = 60.0


async def publish(p: NodeParts) -> None:
    """Write this node's holdings as of the time they carry (taken before they are read:
    whatever was held then is in them)."""
    now = time.time()
    stacks = await p.block.client.list()
    held = {d for info in stacks for d in info.layers} | set(p.layer_pins)
    await p.manifests.put_doc(PREFIX + p.config.node_id, {
        "node": p.config.node_id, "updated_at": now, "layers": sorted(held)})


def others(p: NodeParts, docs: dict[str, dict[str, Any]], now: float) -> dict[str, float]:
    """Drop from `docs` the holdings of nodes gone (older than `node_expiry_s`); returns
    when each other node still there last published its own."""
    out: dict[str, float] = {}
    for name, doc in list(docs.items()):
        if not name.startswith(PREFIX) or name == PREFIX + p.config.node_id:
            continue
        try:
            at = float(doc["updated_at"])
        except (KeyError, TypeError, ValueError):
            at = 0.0
        if now - at > p.config.node_expiry_s:
            del docs[name]  # a node gone: neither a root nor waited for
        else:
            out[name[len(PREFIX):]] = at
    return out


def ready(p: NodeParts, candidates: list[str], peers: dict[str, float],
          now: float) -> set[str]:
    """Of the layers unreferenced now (`candidates`, hex), those that may go: found
    unreferenced before every other node's last holdings. Remembers the rest."""
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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(left))
    os.replace(tmp, path)
    if left:
        log.info("%d unreferenced layers wait for %d other nodes' holdings", len(left),
                 len(peers))
    return out
