"""The real Python e2b SDK (2.63) against our REST API over the in-memory Orchestrator
double. The double makes this a unit test of the HTTP mapping only (allowed here for that
purpose); once the VM-backed orchestrator lands the same calls become end-to-end tests.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from e2b import ALL_TRAFFIC, AsyncSandbox, Sandbox, SandboxQuery
from e2b import SandboxState as SdkState
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

from host.orchestrator.states import SandboxState

from .conftest import API_KEY
from .double import FakeOrchestrator


@pytest.fixture
def sdk_env(api_server, monkeypatch):
    monkeypatch.setenv("E2B_API_URL", api_server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", "sbx.test")
    for var in ("E2B_DEBUG", "E2B_SANDBOX_URL", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return api_server


def test_create_connect_info_kill(sdk_env, orch: FakeOrchestrator) -> None:
    sbx = Sandbox.create(template="base", metadata={"owner": "me"}, timeout=120)
    assert sbx.sandbox_id in orch.sandboxes
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"owner": "me"}
    assert info.state == SdkState.RUNNING and str(info.envd_version) == "0.6.13"
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.sandbox_id == sbx.sandbox_id
    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False           # 404 -> False


def test_list_with_metadata_and_state(sdk_env, orch: FakeOrchestrator) -> None:
    a = orch.add(metadata={"team name": "x/y&z"})
    orch.add(metadata={"team name": "other"})
    paused = orch.add(metadata={"team name": "x/y&z"}, state=SandboxState.PAUSED)
    pager = Sandbox.list(query=SandboxQuery(metadata={"team name": "x/y&z"},
                                            state=[SdkState.RUNNING]))
    assert [s.sandbox_id for s in pager.next_items()] == [a.sandbox_id]
    pager = Sandbox.list(query=SandboxQuery(metadata={"team name": "x/y&z"}))
    assert {s.sandbox_id for s in pager.next_items()} == {a.sandbox_id, paused.sandbox_id}


# Stored start times with sub-microsecond digits (as time.time() gives): the startedAt the
# API returns is rounded to the microsecond, up for the first two, down for the third; the
# last is exact.
NOISY_STARTS = [1_800_000_000.1234567, 1_800_000_000.9999996, 1_700_000_000.0000004,
                1_800_000_000.25]


@pytest.mark.parametrize("started_at", NOISY_STARTS)
def test_list_started_after_is_inclusive(sdk_env, orch: FakeOrchestrator,
                                         started_at: float) -> None:
    sid = orch.add(started_at=started_at).sandbox_id
    [listed] = Sandbox.list().next_items()
    t = listed.started_at
    got = Sandbox.list(query=SandboxQuery(started_after=t)).next_items()
    assert [s.sandbox_id for s in got] == [sid]
    later = SandboxQuery(started_after=t + timedelta(seconds=1))
    assert Sandbox.list(query=later).next_items() == []


@pytest.mark.parametrize("started_at", NOISY_STARTS)
async def test_async_list_started_after_is_inclusive(sdk_env, orch: FakeOrchestrator,
                                                     started_at: float) -> None:
    sid = orch.add(started_at=started_at).sandbox_id
    [listed] = await AsyncSandbox.list().next_items()
    t = listed.started_at
    got = await AsyncSandbox.list(query=SandboxQuery(started_after=t)).next_items()
    assert [s.sandbox_id for s in got] == [sid]
    later = SandboxQuery(started_after=t + timedelta(seconds=1))
    assert await AsyncSandbox.list(query=later).next_items() == []


@pytest.mark.parametrize(("network", "member"), [
    ({"allow_out": ["example.com"], "deny_out": [ALL_TRAFFIC]}, "network.allowOut"),
    ({"egress_proxy": {"address": "proxy.example.com:1080"}}, "network.egressProxy"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]}},
     "network.rules"),
])
def test_network_options_not_honoured_are_refused(sdk_env, orch: FakeOrchestrator,
                                                  network: dict, member: str) -> None:
    with pytest.raises(SandboxException, match=member):
        Sandbox.create(network=network)
    assert orch.sandboxes == {}


def test_list_paginates(sdk_env, orch: FakeOrchestrator) -> None:
    ids = {orch.add().sandbox_id for _ in range(5)}
    pager = Sandbox.list(limit=2)
    seen = []
    while pager.has_next:
        seen += [s.sandbox_id for s in pager.next_items()]
    assert set(seen) == ids and len(seen) == 5


def test_timeout_pause_and_not_found(sdk_env, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    Sandbox.set_timeout(sid, 60)
    assert ("set_timeout", (sid, 60)) in orch.calls
    assert Sandbox.pause(sid) == sid or Sandbox.get_info(sid).state == SdkState.PAUSED
    assert orch.sandboxes[sid].state is SandboxState.PAUSED
    assert Sandbox.pause(sid) is False                      # 409 -> False
    with pytest.raises(NotFoundException):
        Sandbox.get_info("inope")
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout("inope", 10)
    with pytest.raises(NotFoundException):
        Sandbox.pause("inope")
    with pytest.raises(NotFoundException):
        Sandbox.connect("inope")


def test_snapshots(sdk_env, orch: FakeOrchestrator) -> None:
    sbx = Sandbox.connect(orch.add().sandbox_id)
    snap = sbx.create_snapshot(name="my-snap")
    assert snap.snapshot_id == "team/my-snap:default"
    for _ in range(3):
        sbx.create_snapshot()
    pager = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=3)
    seen = []
    while pager.has_next:
        seen += [s.snapshot_id for s in pager.next_items()]
    assert len(seen) == 4 and "team/my-snap:default" in seen
    assert Sandbox.delete_snapshot("team/my-snap:default") is True
    assert Sandbox.delete_snapshot("team/my-snap:default") is False  # 404 -> False


def test_metrics_and_fork(sdk_env, orch: FakeOrchestrator) -> None:
    sbx = Sandbox.connect(orch.add().sandbox_id)
    assert len(sbx.get_metrics()) == 3
    children = sbx.fork(count=2) if hasattr(sbx, "fork") else []
    assert children  # the double returns one child and one error entry


def test_wrong_key_raises_authentication(sdk_env, monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "nope")
    with pytest.raises(AuthenticationException):
        Sandbox.list().next_items()
