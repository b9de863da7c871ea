"""Placement strategies (pure): which nodes fit, in which order, and the refusal message."""

from __future__ import annotations

import dataclasses

from host.cluster.placement import Demand, Strategy, load, rank, refusal, refusal_message
from host.cluster.registry import NodeRecord, NodeState

D = Demand(256)


def node(node_id: str, **over: object) -> NodeRecord:
    base = NodeRecord(node_id=node_id, address="http://a:1", proxy_address="http://a:2",
                      state=NodeState.READY, cpu_count=4, memory_mib=16384, max_sandboxes=0,
                      reserve_mib=1024, available_mib=8192, used_memory_mib=8192,
                      used_sandboxes=0, load=0.0, sandboxes=0, pending=0, last_heartbeat=1.0)
    return dataclasses.replace(base, **over)  # type: ignore[arg-type]


def test_refusals() -> None:
    assert refusal(node("a"), D) is None
    assert refusal(node("a", state=NodeState.DEAD), D) == "dead"
    assert refusal(node("a", state=NodeState.DRAINING), D) == "draining"
    assert str(refusal(node("a", max_sandboxes=2, used_sandboxes=1, pending=1), D)).startswith(
        "full (2/2")
    assert "out of memory" in str(refusal(node("a", available_mib=1200), D))
    # reservations count against memory too
    assert refusal(node("a", available_mib=1400), D) is None
    assert refusal(node("a", available_mib=1400, pending=1), D) is not None


def test_least_loaded_prefers_free_memory_then_fewer_sandboxes() -> None:
    busy = node("a", available_mib=2048)
    idle = node("b", available_mib=12000)
    assert [n.node_id for n in rank([busy, idle], D, Strategy.LEAST_LOADED)] == ["b", "a"]
    # equal machines (within 1%): fewer sandboxes first, then by id
    x = node("x", used_sandboxes=3)
    y = node("y", used_sandboxes=1, available_mib=8100)
    z = node("z", used_sandboxes=1)
    assert [n.node_id for n in rank([x, z, y], D, Strategy.LEAST_LOADED)] == ["y", "z", "x"]
    # a reservation counts as a sandbox and as the memory it will take
    w = node("w", pending=1)
    assert [n.node_id for n in rank([w, node("v")], D, Strategy.LEAST_LOADED)] == ["v", "w"]
    # the sandbox limit counts as load
    assert load(node("a", max_sandboxes=4, used_sandboxes=3), D) == 1.0
    assert rank([node("a", state=NodeState.DEAD)], D, Strategy.LEAST_LOADED) == []
    # CPU load pushes a node back
    hot = node("h", load=8.0)
    assert [n.node_id for n in rank([hot, node("c")], D, Strategy.LEAST_LOADED)] == ["c", "h"]


def test_round_robin_rotates_over_fitting_nodes() -> None:
    nodes = [node("c"), node("a"), node("b"), node("d", state=NodeState.DEAD)]
    firsts = [rank(nodes, D, Strategy.ROUND_ROBIN, turn)[0].node_id for turn in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert rank([], D, Strategy.ROUND_ROBIN, 3) == []


def test_refusal_message_names_every_node() -> None:
    msg = refusal_message([node("a", state=NodeState.DEAD),
                           node("b", max_sandboxes=1, used_sandboxes=1), node("c")], D,
                          excluded=["c"])
    assert "a: dead" in msg and "b: full" in msg and "c: refused the sandbox" in msg
    assert "no node is registered" in refusal_message([], D)
