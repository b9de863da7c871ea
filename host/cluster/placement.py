"""Where a new sandbox goes: which nodes can take it and in which order to try them, from
the nodes' heartbeats (pure functions; the scheduler reserves the place).

A node can take a sandbox when it is `ready`, stays under its sandbox limit counting the
places already reserved on it, and keeps its memory reserve after the places reserved and
this one (`Demand.memory_mib` each: what a restored sandbox touches early, as the node's
admission assumes; the node's own admission check stays the final word).

    least-loaded  (default) lowest load first: the larger of the memory used and the share
                  of the sandbox limit taken, plus a quarter of the CPU load per core;
                  nodes within 1% of each other are equal, and then the one with fewer
                  sandboxes goes first (so equal machines fill evenly), then by id
    round-robin   the nodes that fit, by id, starting one further at each placement
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .registry import NodeRecord, NodeState


class Strategy(str, enum.Enum):
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class Demand:
    memory_mib: int = 256


def refusal(node: NodeRecord, demand: Demand) -> str | None:
    """Why `node` cannot take the sandbox now; None when it can."""
    if node.state is not NodeState.READY:
        return str(node.state.value)
    held = node.used_sandboxes + node.pending
    if node.max_sandboxes and held >= node.max_sandboxes:
        return f"full ({held}/{node.max_sandboxes} sandboxes, placements included)"
    free = node.available_mib - node.pending * demand.memory_mib
    if free - demand.memory_mib < node.reserve_mib:
        return (f"out of memory ({free} MiB available, {demand.memory_mib} MiB needed, "
                f"{node.reserve_mib} MiB kept in reserve)")
    return None


def load(node: NodeRecord, demand: Demand) -> float:
    """The node's load once it took the sandbox (0: idle; 1: full)."""
    free = node.available_mib - (node.pending + 1) * demand.memory_mib
    memory = 1 - free / node.memory_mib if node.memory_mib > 0 else 1.0
    slots = ((node.used_sandboxes + node.pending + 1) / node.max_sandboxes
             if node.max_sandboxes else 0.0)
    cpu = node.load / max(1, node.cpu_count)
    return max(memory, slots) + 0.25 * min(cpu, 4.0)


def rank(nodes: Iterable[NodeRecord], demand: Demand, strategy: Strategy,
         turn: int = 0) -> list[NodeRecord]:
    """The nodes that can take the sandbox, best first (`turn`: the round-robin turn)."""
    fit = [n for n in nodes if refusal(n, demand) is None]
    if strategy is Strategy.ROUND_ROBIN:
        fit.sort(key=lambda n: n.node_id)
        if not fit:
            return fit
        start = turn % len(fit)
        return fit[start:] + fit[:start]
    return sorted(fit, key=lambda n: (round(load(n, demand), 2),
                                      n.used_sandboxes + n.pending, n.node_id))


def refusal_message(nodes: Sequence[NodeRecord], demand: Demand,
                    excluded: Iterable[str] = ()) -> str:
    """The capacity error's message: why each node was passed over."""
    skipped = set(excluded)
    if not nodes:
        return "no node is registered in the cluster; start nodes with --cluster-redis"
    reasons = []
    for n in nodes:
        why = "refused the sandbox" if n.node_id in skipped else refusal(n, demand)
        reasons.append(f"{n.node_id}: {why or 'busy'}")
    return ("no node can take another sandbox (" + "; ".join(reasons)
            + "); kill or pause sandboxes, or retry later")
