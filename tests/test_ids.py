"""host/ids.py: the one sandbox-id rule, and the wider forms that contain it. An id the
service issues is accepted by every layer's check; what is clearly not an id is refused
where that matters (the proxy's 400, the CLI's subcommand typos, the gateway's fan-out)."""

from __future__ import annotations

import pytest

from host import ids
from host.cluster.gateway.app import _PORT_HOST
from host.metrics.logs import _SANDBOX_ID as LOGGED
from host.orchestrator import ids as orchestrator_ids
from host.proxy.routing import BadTarget, Target, parse_target
from host.runtime.parts import build_stack


def test_issued_ids_pass_every_layer() -> None:
    for _ in range(200):
        sid = ids.new_sandbox_id()
        assert len(sid) == 21 and sid.startswith("i")
        assert ids.is_sandbox_id(sid) and ids.is_routable_id(sid) and ids.is_vm_name(sid)
        assert orchestrator_ids.new_sandbox_id.__module__ == "host.ids"
        assert orchestrator_ids.SANDBOX_ID.fullmatch(sid)
        assert parse_target(f"49983-{sid}.sbx.test", None, None, "sbx.test") == Target(sid, 49983)
        assert parse_target("localhost", sid, "8000", None) == Target(sid, 8000)
        assert _PORT_HOST.match(f"8000-{sid}.sbx.test")
        assert LOGGED.search(f"/sandboxes/{sid}/pause").group(1) == sid   # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["", "lss", "abc123", "i" + "a" * 19, "i" + "a" * 21,
                                   "I" + "a" * 20, "i" + "a" * 19 + "-", "i" + "a" * 20 + "\n"])
def test_what_is_not_an_issued_id(value: str) -> None:
    assert not ids.is_sandbox_id(value)


@pytest.mark.parametrize("value", ["abc", "x1", "i" + "a" * 40])
def test_routable_but_not_issued(value: str) -> None:
    """E2B's own rule for what a request may name: not ours, but "not found", not 400."""
    assert ids.is_routable_id(value) and not ids.is_sandbox_id(value)
    assert parse_target(f"80-{value}.d.test", None, None, None).sandbox_id == value


@pytest.mark.parametrize("value", ["", "ABC", "a_b", "a.b", "a-b", "a b"])
def test_not_routable(value: str) -> None:
    assert not ids.is_routable_id(value)
    with pytest.raises(BadTarget):
        parse_target("localhost", value, "80", None)


def test_vm_names_cover_builds_and_refuse_paths() -> None:
    """The network layer names namespaces after VMs, builds' and imports' too."""
    stack = build_stack("t" + "a" * 20)
    for name in (stack, f"{stack}-i", f"{stack}-t", "sbx1"):
        assert ids.is_vm_name(name) and not ids.is_sandbox_id(name)
    for bad in ("", "../x", "a/b", ".hidden", "-x", "a" * 64):
        assert not ids.is_vm_name(bad)


def test_snapshot_names() -> None:
    sid = ids.new_sandbox_id()
    assert orchestrator_ids.public_snapshot_id("team/snap", sid) == "team/snap:default"
    assert ids.SNAPSHOT_NAME.match(f"{sid}:abc12345")
    with pytest.raises(ValueError):
        orchestrator_ids.public_snapshot_id("bad name", sid)
