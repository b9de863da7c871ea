"""NodeOrchestrator state-machine logic over an in-process SandboxRuntime test double.

Unit tests of the orchestrator's state machine ONLY (transitions and conflicts,
serialization of concurrent operations on one sandbox, TTL expiry and paused time,
timeouts, idempotency, fork bookkeeping, events, routing decisions). The runtime double
(tests/orchestrator/fakes.py) runs no VM; the VM-backed behaviour is in test_node_vm.py.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import (
    Conflict,
    GuestUnresponsive,
    IdempotencyMismatch,
    InvalidRequest,
    OperationFailed,
    SandboxNotFound,
    SnapshotNotFound,
    StateConflict,
)
from host.orchestrator.model import CreateRequest, ListFilter, NetworkConfig
from host.orchestrator.records import PUBLIC_PAUSED
from host.orchestrator.states import SandboxState as S

from .fakes import Clock

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def orch(store, rt, envd, clock):
    o = NodeOrchestrator(store, rt, domain="sbx.test", clock=clock,
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)  # ticks are driven by hand below
    yield o
    await o.aclose()


async def test_create_builds_template_once_and_inits_envd(orch, rt, envd):
    infos = await asyncio.gather(*(orch.create(CreateRequest(env_vars={"FOO": "bar"}))
                                   for _ in range(5)))
    assert rt.builds == 1
    assert len({i.sandbox_id for i in infos}) == 5
    assert all(re.fullmatch(r"i[a-z0-9]{20}", i.sandbox_id) for i in infos)
    assert all(i.state is S.RUNNING and i.template_id == "base" and i.alias == "base"
               for i in infos)
    assert len({i.envd_access_token for i in infos}) == 5
    assert len(envd.inits) == 5
    _, body, headers = envd.inits[0]
    assert body["envVars"] == {"FOO": "bar"}
    assert body["defaultUser"] == "user" and body["defaultWorkdir"] == "/home/user"
    assert body["accessToken"] in {i.envd_access_token for i in infos}
    assert body["timestamp"].endswith("Z")
    assert "x-access-token" not in headers  # a template holds no token


async def test_create_unknown_template_is_404(orch, store):
    with pytest.raises(SnapshotNotFound):
        await orch.create(CreateRequest(template_id="nope"))
    assert store.list_sandboxes() == []


async def test_create_start_failure_rolls_back(orch, rt, store):
    rt.fail["start"] = lambda sid: True
    with pytest.raises(OperationFailed):
        await orch.create(CreateRequest())
    (rec,) = store.list_sandboxes()
    assert rec.state is S.KILLED
    assert rt.vms == {}
    assert await orch.list(ListFilter()) == []


async def test_create_init_failure_kills_vm(orch, rt, envd, store):
    await orch.create(CreateRequest())  # template built
    envd.fail_hosts.update(f"10.9.0.{n}" for n in range(1, 250))
    with pytest.raises(OperationFailed):
        await orch.create(CreateRequest())
    assert {r.state for r in store.list_sandboxes()} == {S.RUNNING, S.KILLED}
    assert len(rt.vms) == 1
    killed = [r.id for r in store.list_sandboxes() if r.state is S.KILLED]
    assert rt.ops("kill") == [(killed[0],)]


async def test_get_list_filters(orch, clock):
    a = await orch.create(CreateRequest(metadata={"team": "x", "k": "1"}))
    clock.advance(10)
    b = await orch.create(CreateRequest(metadata={"team": "x", "k": "2"}))
    await orch.pause(b.sandbox_id)
    got = await orch.list(ListFilter(metadata={"team": "x"}))
    assert {i.sandbox_id for i in got} == {a.sandbox_id, b.sandbox_id}
    got = await orch.list(ListFilter(metadata={"team": "x", "k": "2"}))
    assert [i.sandbox_id for i in got] == [b.sandbox_id]
    got = await orch.list(ListFilter(states=frozenset({S.RUNNING})))
    assert [i.sandbox_id for i in got] == [a.sandbox_id]
    got = await orch.list(ListFilter(states=frozenset({S.PAUSED})))
    assert [i.sandbox_id for i in got] == [b.sandbox_id]
    assert await orch.list(ListFilter(template="other")) == []
    assert len(await orch.list(ListFilter(template="base"))) == 2
    got = await orch.list(ListFilter(started_after=a.started_at))
    assert [i.sandbox_id for i in got] == [b.sandbox_id]
    await orch.kill(a.sandbox_id)
    with pytest.raises(SandboxNotFound):
        await orch.get(a.sandbox_id)
    with pytest.raises(SandboxNotFound):
        await orch.kill(a.sandbox_id)
    assert a.sandbox_id not in rt_vms(orch)


def rt_vms(orch):
    return orch.runtime.vms


async def test_pause_resume_conflicts_and_token(orch, rt, envd, clock):
    info = await orch.create(CreateRequest(timeout_s=100))
    sid = info.sandbox_id
    await orch.pause(sid)
    assert (await orch.get(sid)).state is S.PAUSED
    assert sid not in rt.vms
    with pytest.raises(StateConflict):
        await orch.pause(sid)
    with pytest.raises(StateConflict):
        await orch.snapshot(sid, "x")
    # (a paused sandbox forks: test_fork_of_a_paused_sandbox_leaves_it_paused)
    resumed, was_paused = await orch.connect(sid, None)
    assert was_paused and resumed.state is S.RUNNING
    assert resumed.envd_access_token == info.envd_access_token  # stable across resume
    _, body, headers = envd.inits[-1]
    assert headers["x-access-token"] == info.envd_access_token
    assert body["accessToken"] == info.envd_access_token
    again, was_paused = await orch.connect(sid, None)
    assert not was_paused and again.end_at == resumed.end_at


async def test_filesystem_only_pause_syncs_and_resumes_by_reboot(orch, rt, envd, store):
    info = await orch.create(CreateRequest(timeout_s=100))
    sid = info.sandbox_id
    host = rt.vms[sid].envd_host
    envd.sync_fails.add(host)  # envd cannot sync: refused, nothing changed
    with pytest.raises(GuestUnresponsive):
        await orch.pause(sid, memory=False)
    assert (await orch.get(sid)).state is S.RUNNING and sid in rt.vms
    assert rt.memory_flags == []
    envd.sync_fails.clear()
    envd.sync_exit[host] = 1   # /bin/sync ran and failed (an I/O error): refused too
    with pytest.raises(GuestUnresponsive):
        await orch.pause(sid, memory=False)
    assert (await orch.get(sid)).state is S.RUNNING and rt.memory_flags == []
    envd.sync_exit.clear()
    await orch.pause(sid, memory=False)
    assert envd.syncs[-1][:2] == (host, "/bin/sync")
    assert envd.syncs[-1][2].startswith("Basic ")  # as root
    assert rt.memory_flags == [False]
    paused = await orch.get(sid)
    assert paused.state is S.PAUSED and paused.pause_mode == "filesystem"
    resumed, was_paused = await orch.connect(sid, None)  # a filesystem pause reboots
    assert was_paused and rt.reboots == [sid] and resumed.pause_mode is None
    _, body, headers = envd.inits[-1]
    assert "x-access-token" not in headers  # a fresh envd holds no token yet
    assert body["accessToken"] == info.envd_access_token  # the SDK's handle still works
    # a full pause resumed as a reboot (on_resume="reboot")
    await orch.pause(sid)
    assert (await orch.get(sid)).pause_mode == "full"
    await orch.connect(sid, None, memory=False)
    assert rt.reboots == [sid, sid] and rt.memory_flags == [False, True]
    # strict pause: envd must answer /health
    envd.stopped_hosts.add(rt.vms[sid].envd_host)
    with pytest.raises(GuestUnresponsive):
        await orch.pause(sid, require_healthy=True)
    assert (await orch.get(sid)).state is S.RUNNING
    ops = [e.detail.get("op") for e in store.events(sid)]
    assert ops.count("paused") == 2 and "pause_failed" not in ops


async def test_connect_only_grows_ttl_of_running(orch, clock):
    sid = (await orch.create(CreateRequest(timeout_s=600))).sandbox_id
    end = (await orch.get(sid)).end_at
    await orch.connect(sid, 60)
    assert (await orch.get(sid)).end_at == end
    await orch.connect(sid, 6000)
    assert (await orch.get(sid)).end_at == clock() + 6000


async def test_paused_time_does_not_count(orch, clock):
    sid = (await orch.create(CreateRequest(timeout_s=100))).sandbox_id
    clock.advance(30)
    await orch.pause(sid)
    clock.advance(10_000)
    assert (await orch.get(sid)).end_at == pytest.approx(clock() + 70)
    await orch.connect(sid, None)  # no timeout given: the TTL left when paused
    assert (await orch.get(sid)).end_at == pytest.approx(clock() + 70)
    await orch.pause(sid)
    await orch.connect(sid, 500)  # a connect timeout sets a new TTL
    assert (await orch.get(sid)).end_at == pytest.approx(clock() + 500)


async def test_set_and_extend_timeout(orch, clock):
    sid = (await orch.create(CreateRequest(timeout_s=300))).sandbox_id
    await orch.set_timeout(sid, 10)  # may shorten
    assert (await orch.get(sid)).end_at == clock() + 10
    await orch.extend_timeout(sid, 5)  # never shortens
    assert (await orch.get(sid)).end_at == clock() + 10
    await orch.extend_timeout(sid, 50)
    assert (await orch.get(sid)).end_at == clock() + 50
    await orch.pause(sid)
    await orch.set_timeout(sid, 42)
    assert (await orch.get(sid)).end_at == clock() + 42
    with pytest.raises(InvalidRequest):
        await orch.set_timeout(sid, -1)
    with pytest.raises(SandboxNotFound):
        await orch.set_timeout("i" + "0" * 20, 5)


async def test_ttl_expiry_pauses_or_kills(orch, clock, store):
    keep = (await orch.create(CreateRequest(timeout_s=100))).sandbox_id
    p = (await orch.create(CreateRequest(timeout_s=10))).sandbox_id
    k = (await orch.create(CreateRequest(timeout_s=10, auto_pause=False))).sandbox_id
    clock.advance(11)
    assert set(await orch.expired()) == {p, k}
    assert await orch.expire(p) == "paused"
    assert await orch.expire(k) == "killed"
    assert await orch.expire(keep) is None
    assert (await orch.get(p)).state is S.PAUSED
    with pytest.raises(SandboxNotFound):
        await orch.get(k)
    assert (await orch.get(keep)).state is S.RUNNING
    ops = [e.detail.get("op") for e in store.events(p)]
    assert ops[-1] == "timeout"
    # expired while paused: resuming without a timeout gets the default TTL
    await orch.connect(p, None)
    assert (await orch.get(p)).end_at == clock() + orch.default_timeout_s


async def test_ttl_pause_without_memory(orch, rt, envd, clock):
    """autoPauseMemory false: the TTL pause keeps the filesystem only (after a guest sync);
    a guest that cannot sync is paused with its memory rather than losing anything."""
    fs = (await orch.create(CreateRequest(timeout_s=10, auto_pause_memory=False))).sandbox_id
    mute = (await orch.create(CreateRequest(timeout_s=10, auto_pause_memory=False))).sandbox_id
    envd.sync_fails.add(rt.vms[mute].envd_host)
    clock.advance(11)
    assert await orch.expire(fs) == "paused" and await orch.expire(mute) == "paused"
    assert (await orch.get(fs)).pause_mode == "filesystem"
    assert (await orch.get(mute)).pause_mode == "full"
    assert rt.memory_flags == [False, True]
    kids = await orch.fork((await orch.connect(fs, 60))[0].sandbox_id, 1, 10)
    assert kids[0].sandbox is not None  # a fork inherits the setting
    clock.advance(11)
    assert await orch.expire(kids[0].sandbox.sandbox_id) == "paused"
    assert (await orch.get(kids[0].sandbox.sandbox_id)).pause_mode == "filesystem"


async def test_ttl_extension_wins_over_expiry(orch, clock):
    sid = (await orch.create(CreateRequest(timeout_s=10))).sandbox_id
    clock.advance(11)
    assert await orch.expired() == [sid]
    await orch.set_timeout(sid, 100)
    assert await orch.expire(sid) is None
    assert (await orch.get(sid)).state is S.RUNNING


async def test_ttl_loop_real_time(store, rt, envd):
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=0.05)
    try:
        p = (await o.create(CreateRequest(timeout_s=1))).sandbox_id
        k = (await o.create(CreateRequest(timeout_s=1, auto_pause=False))).sandbox_id
        for _ in range(100):
            await asyncio.sleep(0.05)
            if store.get_sandbox(p).state is S.PAUSED and store.get_sandbox(k).state is S.KILLED:
                break
        assert store.get_sandbox(p).state is S.PAUSED
        assert store.get_sandbox(k).state is S.KILLED
        assert rt.vms == {}
    finally:
        await o.aclose()


async def test_watchdog_keeps_the_disk_of_vms_that_exit_by_themselves(store, rt, envd):
    """A VM that dies while its sandbox runs (crash, OOM kill): its streams end, and the
    sandbox becomes paused on a new filesystem-only snapshot of its disk as it was (issue
    14 item 18: not on its last snapshot, losing what it wrote since, nor killed)."""
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=0.05)
    try:
        fresh = (await o.create(CreateRequest(timeout_s=600))).sandbox_id
        cycled = (await o.create(CreateRequest(timeout_s=600))).sandbox_id
        await o.pause(cycled)
        await o.connect(cycled, None)
        last = store.get_sandbox(cycled).snapshot_id
        gone = (await o.route(fresh, 49983, resume=False)).gone
        assert gone is not None and not gone.is_set()
        rt.dead |= {fresh, cycled}
        for _ in range(100):  # until settled in the store (the VMs go first)
            await asyncio.sleep(0.05)
            if not rt.exited() and {store.get_sandbox(fresh).state,
                                    store.get_sandbox(cycled).state} <= {S.KILLED, S.PAUSED}:
                break
        assert gone.is_set() and "VM exited" in gone.reason
        for sid in (fresh, cycled):
            rec = store.get_sandbox(sid)
            assert rec.state is S.PAUSED and rec.snapshot_id not in (None, last)
            assert rec.runtime.get("pause_mode") == "filesystem"
            ops = [e.detail.get("op") for e in store.events(sid)]
            assert ops[-1] == "vm_exited"
        assert rt.memory_flags[-2:] == [False, False]   # disk-only snapshots
        rt.reboots.clear()
        await o.connect(fresh, None)   # resumed by a cold boot of the kept disk
        assert store.get_sandbox(fresh).state is S.RUNNING and rt.reboots == [fresh]
        assert await o.vm_exited(fresh) is None  # alive: nothing to do
    finally:
        await o.aclose()


async def test_watchdog_falls_back_to_the_last_snapshot_when_the_disk_cannot_be_kept(
        store, rt, envd):
    """When the disk-only snapshot fails too, the sandbox is paused on its last snapshot,
    or killed without one, and nothing of its VM is left."""
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=0.05)
    try:
        fresh = (await o.create(CreateRequest(timeout_s=600))).sandbox_id
        cycled = (await o.create(CreateRequest(timeout_s=600))).sandbox_id
        await o.pause(cycled)
        await o.connect(cycled, None)
        last = store.get_sandbox(cycled).snapshot_id
        rt.fail["snapshot"] = lambda sid: True
        rt.dead |= {fresh, cycled}
        for _ in range(100):
            await asyncio.sleep(0.05)
            if not rt.exited() and {store.get_sandbox(fresh).state,
                                    store.get_sandbox(cycled).state} <= {S.KILLED, S.PAUSED}:
                break
        assert store.get_sandbox(fresh).state is S.KILLED
        rec = store.get_sandbox(cycled)
        assert rec.state is S.PAUSED and rec.snapshot_id == last
        assert ("kill", (fresh,)) in rt.calls and ("kill", (cycled,)) in rt.calls
        del rt.fail["snapshot"]
        await o.connect(cycled, None)  # resumable from that snapshot
        assert store.get_sandbox(cycled).state is S.RUNNING
    finally:
        await o.aclose()


async def test_concurrent_ops_on_one_sandbox_are_serialized(orch, rt):
    sid = (await orch.create(CreateRequest())).sandbox_id
    gate = rt.gates["snapshot"] = asyncio.Event()
    first = asyncio.create_task(orch.pause(sid))
    second = asyncio.create_task(orch.pause(sid))
    kill = asyncio.create_task(orch.kill(sid))
    await asyncio.sleep(0.05)
    assert (await orch.get(sid)).state is S.PAUSING
    assert not kill.done()  # waits for the pause, does not race it
    gate.set()
    results = await asyncio.gather(first, second, kill, return_exceptions=True)
    assert results[0] is None
    assert isinstance(results[1], StateConflict)
    assert results[2] is None
    order = [op for op, _ in rt.calls if op in ("snapshot", "kill")]
    assert order == ["snapshot", "kill"]


async def test_pause_answers_once_stopped_and_holds_the_sandbox_until_committed(orch, rt,
                                                                              store):
    """The API's pause returns once the guest is stopped; the snapshot is committed
    behind the sandbox's lock: a resume or kill meanwhile waits for it, and the sandbox
    reads as paused all along."""
    rt.answer_on_stop = True
    sid = (await orch.create(CreateRequest())).sandbox_id
    gate = rt.gates["snapshot"] = asyncio.Event()
    await asyncio.wait_for(orch.pause(sid), 5)  # answered while the snapshot is gated
    assert store.get_sandbox(sid).state is S.PAUSING
    assert (await orch.get(sid)).state in PUBLIC_PAUSED  # the API says "paused"
    resume = asyncio.create_task(orch.connect(sid, None))
    await asyncio.sleep(0.05)
    assert not resume.done()  # waits for the commit, does not see `pausing`
    gate.set()
    info, resumed = await asyncio.wait_for(resume, 5)
    assert resumed and info.state is S.RUNNING
    order = [op for op, _ in rt.calls if op in ("snapshot", "start")]
    assert order[-2:] == ["snapshot", "start"]
    assert store.get_sandbox(sid).snapshot_id is not None
    # a failure after the answer: logged, and the sandbox runs again (nothing lost)
    rt.gates.pop("snapshot")
    rt.fail["snapshot"] = lambda s: True
    await orch.pause(sid)
    await orch.kill(sid)  # waits for the failed pause, then kills the running sandbox
    assert store.get_sandbox(sid).state is S.KILLED
    assert "pause_failed" in [e.detail.get("op") for e in store.events(sid)]


async def test_pause_for_memory_waits_for_the_commit(orch, rt, store):
    rt.answer_on_stop = True
    sid = (await orch.create(CreateRequest())).sandbox_id
    await orch.pause_for_memory(sid)
    assert store.get_sandbox(sid).state is S.PAUSED
    assert sid not in rt.vms


async def test_client_cancel_does_not_half_finish(orch, rt):
    sid = (await orch.create(CreateRequest())).sandbox_id
    gate = rt.gates["snapshot"] = asyncio.Event()
    caller = asyncio.create_task(orch.pause(sid))
    await asyncio.sleep(0.05)
    caller.cancel()  # the HTTP client went away
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    for _ in range(50):
        await asyncio.sleep(0.01)
        if (await orch.get(sid)).state is S.PAUSED:
            break
    assert (await orch.get(sid)).state is S.PAUSED


async def test_pause_failure_goes_back_to_running(orch, rt, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    rt.fail["snapshot"] = lambda s: True
    with pytest.raises(OperationFailed):
        await orch.pause(sid)
    rec = store.get_sandbox(sid)
    assert rec.state is S.RUNNING and "pending" not in rec.runtime


async def test_resume_failure_goes_back_to_paused(orch, rt):
    sid = (await orch.create(CreateRequest())).sandbox_id
    await orch.pause(sid)
    rt.fail["start"] = lambda s: True
    with pytest.raises(OperationFailed):
        await orch.connect(sid, None)
    assert (await orch.get(sid)).state is S.PAUSED
    rt.fail.clear()
    assert (await orch.connect(sid, None))[1] is True


async def test_named_snapshot_and_create_from_it(orch, rt, envd):
    src = await orch.create(CreateRequest(metadata={"a": "b"}))
    snap = await orch.snapshot(src.sandbox_id, "team/snap")
    assert snap.snapshot_id == "team/snap:default" and snap.names == ("team/snap:default",)
    unnamed = await orch.snapshot(src.sandbox_id, None)
    assert unnamed.snapshot_id.startswith(src.sandbox_id + ":")
    assert (await orch.get(src.sandbox_id)).state is S.RUNNING
    ids = {s.snapshot_id for s in await orch.list_snapshots(src.sandbox_id, None)}
    assert ids == {snap.snapshot_id, unnamed.snapshot_id}
    assert [s.snapshot_id for s in await orch.list_snapshots(None, "team/snap")] == [
        snap.snapshot_id]
    child = await orch.create(CreateRequest(template_id="team/snap:default"))
    assert child.template_id == "team/snap:default"
    assert child.envd_access_token != src.envd_access_token
    _, body, headers = envd.inits[-1]
    assert headers["x-access-token"] == src.envd_access_token  # what envd held in the snapshot
    assert body["accessToken"] == child.envd_access_token
    await orch.delete_snapshot(snap.snapshot_id)
    with pytest.raises(SnapshotNotFound):
        await orch.delete_snapshot(snap.snapshot_id)
    with pytest.raises(InvalidRequest):
        await orch.snapshot(src.sandbox_id, "bad name!")


async def test_fork_children_and_partial_failure(orch, rt, envd, store):
    parent = await orch.create(CreateRequest(metadata={"m": "1"}, env_vars={"E": "1"}))
    started = []

    def fail_second(sid: str) -> bool:
        started.append(sid)
        return len(started) == 2

    rt.fail["start"] = fail_second
    results = await orch.fork(parent.sandbox_id, 3, 60)
    assert len(results) == 3
    # the runtime hears that 3 starts of one snapshot come at once (one shared image)
    assert rt.fanouts == [1, 3, 3, 3]
    ok = [r.sandbox for r in results if r.sandbox is not None]
    bad = [r for r in results if r.error is not None]
    assert len(ok) == 2 and len(bad) == 1 and bad[0].error_status == 500
    assert len({c.sandbox_id for c in ok} | {parent.sandbox_id}) == 3
    assert all(c.metadata == {"m": "1"} and c.envd_access_token != parent.envd_access_token
               for c in ok)
    assert (await orch.get(parent.sandbox_id)).state is S.RUNNING
    child_inits = envd.inits[-2:]
    assert all(h["x-access-token"] == parent.envd_access_token for _, _, h in child_inits)
    assert {b["accessToken"] for _, b, _ in child_inits} == {c.envd_access_token for c in ok}
    assert all(b["envVars"] == {"E": "1"} for _, b, _ in child_inits)
    assert len([r for r in store.list_sandboxes() if r.parent_id == parent.sandbox_id]) == 3
    with pytest.raises(InvalidRequest):
        await orch.fork(parent.sandbox_id, 0, None)
    with pytest.raises(InvalidRequest):
        await orch.fork(parent.sandbox_id, 17, None)


async def test_fork_of_a_paused_sandbox_leaves_it_paused(orch, rt, envd, store):
    """Children come from the snapshot the parent is paused on; no VM of the parent's
    starts, it stays paused and resumes later from that snapshot; its children keep that
    snapshot while they live. A filesystem-only pause has no memory to fork: 409."""
    parent = await orch.create(CreateRequest(env_vars={"E": "1"}))
    sid = parent.sandbox_id
    await orch.pause(sid)
    paused_on = store.get_sandbox(sid).snapshot_id
    starts = len(rt.ops("start"))
    results = await orch.fork(sid, 3, 60)
    kids = [r.sandbox for r in results if r.sandbox is not None]
    assert len(kids) == 3 and (await orch.get(sid)).state is S.PAUSED
    assert sid not in rt.vms and len(rt.ops("start")) == starts + 3
    assert rt.fanouts[-3:] == [3, 3, 3]
    assert {store.get_sandbox(k.sandbox_id).runtime["origin"] for k in kids} == {paused_on}
    assert all(h["x-access-token"] == parent.envd_access_token for _, _, h in envd.inits[-3:])
    await orch.collect()  # the children use the parent's pause: it stays
    assert store.get_snapshot(paused_on).kind == "pause"
    _, resumed = await orch.connect(sid, None)
    assert resumed and (await orch.get(sid)).state is S.RUNNING
    await orch.pause(sid, memory=False)
    with pytest.raises(Conflict, match="without its memory"):
        await orch.fork(sid, 1, 60)
    await orch.collect()  # no longer the parent's pause: still its children's origin
    assert store.get_snapshot(paused_on).kind == "pause"
    for k in kids:
        await orch.kill(k.sandbox_id)
    await orch.collect()
    with pytest.raises(SnapshotNotFound):
        store.get_snapshot(paused_on)


async def test_idempotency(orch, rt):
    req = CreateRequest(metadata={"x": "1"}, idempotency_key="k1")
    a, b = await asyncio.gather(orch.create(req), orch.create(req))
    assert a.sandbox_id == b.sandbox_id
    c = await orch.create(req)
    assert c.sandbox_id == a.sandbox_id
    assert len(rt.ops("start")) == 1
    with pytest.raises(IdempotencyMismatch):
        await orch.create(CreateRequest(metadata={"x": "2"}, idempotency_key="k1"))
    # a failed create frees the key: a retry creates
    rt.fail["start"] = lambda s: True
    with pytest.raises(OperationFailed):
        await orch.create(CreateRequest(idempotency_key="k2"))
    rt.fail.clear()
    d = await orch.create(CreateRequest(idempotency_key="k2"))
    assert d.state is S.RUNNING


async def test_events_and_logs(orch, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    await orch.pause(sid)
    await orch.connect(sid, None)
    await orch.kill(sid)
    kinds = [(e.kind, e.detail.get("op")) for e in store.events(sid)]
    assert kinds == [("creating", "create"), ("running", "created"), ("pausing", None),
                     ("paused", "paused"), ("resuming", None), ("running", "resumed"),
                     ("killing", "killed"), ("killed", None)]
    lines = [ln.line for ln in await orch.logs(sid, None, 100)]
    assert "sandbox created" in lines and "sandbox resumed" in lines


async def test_route(orch, rt):
    info = await orch.create(CreateRequest(network=NetworkConfig(allow_public_traffic=False)))
    sid = info.sandbox_id
    route = await orch.route(sid, 8080, resume=True)
    assert (route.host, route.port) == (rt.vms[sid].envd_host, 8080)
    assert route.traffic_token == info.traffic_access_token is not None
    await orch.pause(sid)
    with pytest.raises(StateConflict):  # autoResume off
        await orch.route(sid, 49983, resume=True)
    auto = (await orch.create(CreateRequest(auto_resume=True))).sandbox_id
    await orch.pause(auto)
    with pytest.raises(StateConflict):
        await orch.route(auto, 49983, resume=False)
    route = await orch.route(auto, 49983, resume=True)
    assert (await orch.get(auto)).state is S.RUNNING and route.port == 49983
    await orch.kill(auto)
    with pytest.raises(SandboxNotFound):
        await orch.route(auto, 49983, resume=True)


async def test_route_gone_is_set_when_the_run_ends(orch, rt, clock):
    """Route.gone: one event per running incarnation, set (with what happened) once the
    sandbox left `running`, before the VM is stopped; a resumed sandbox gets a new one."""
    sid = (await orch.create(CreateRequest(auto_resume=True))).sandbox_id
    first = await orch.route(sid, 49983, resume=True)
    assert first.gone is not None and not first.gone.is_set()
    assert (await orch.route(sid, 8080, resume=True)).gone is first.gone  # same run
    rt.gates["snapshot"] = gate = asyncio.Event()
    pausing = asyncio.create_task(orch.pause(sid))
    await asyncio.wait_for(rt.entered.setdefault("snapshot", asyncio.Event()).wait(), 5)
    assert first.gone.is_set() and first.gone.reason == "paused"  # VM not stopped yet
    gate.set()
    await pausing
    second = await orch.route(sid, 49983, resume=True)   # auto-resumes: a new run
    assert second.gone is not None and second.gone is not first.gone
    assert not second.gone.is_set()
    await orch.kill(sid)
    assert second.gone.is_set() and second.gone.reason == "killed"
    # TTL expiry (autoPause) and a snapshot (the VM keeps running)
    ttl = (await orch.create(CreateRequest(timeout_s=10))).sandbox_id
    gone = (await orch.route(ttl, 49983, resume=False)).gone
    assert gone is not None
    await orch.snapshot(ttl, None)
    assert not gone.is_set()
    clock.advance(11)
    assert await orch.expire(ttl) == "paused"
    assert gone.is_set() and gone.reason == "paused (its timeout ran out)"
    await orch.kill(ttl)  # a paused sandbox has no run left to end
    assert not orch._runs


async def test_metrics_of_a_sandbox_paused_meanwhile_are_none_not_an_error(orch, envd):
    sid = (await orch.create(CreateRequest())).sandbox_id
    asked = orch._ctx.envd.metrics

    async def paused_meanwhile(placement, token):  # its timeout's pause took the VM
        await orch.pause(sid)
        raise OperationFailed("envd /metrics failed: All connection attempts failed")

    orch._ctx.envd.metrics = paused_meanwhile
    assert await orch.metrics(sid) == []
    # a running sandbox whose envd does not answer is still an error
    orch._ctx.envd.metrics = asked
    running = (await orch.create(CreateRequest())).sandbox_id
    envd.fail_hosts.update(envd.tokens)
    with pytest.raises(OperationFailed, match="answered 500"):
        await orch.metrics(running)


async def test_metrics_and_network(orch, rt):
    sid = (await orch.create(CreateRequest())).sandbox_id
    (m,) = await orch.metrics(sid)
    assert m.cpu_count == 2 and m.mem_total == 10
    net = NetworkConfig(deny_out=("0.0.0.0/0",))
    await orch.update_network(sid, net)
    assert rt.ops("update_network") == [(sid, net)]
    assert (await orch.get(sid)).network.deny_out == ("0.0.0.0/0",)
    await orch.pause(sid)
    assert await orch.metrics(sid) == []
    await orch.update_network(sid, NetworkConfig())
    assert len(rt.ops("update_network")) == 1  # applied at resume, not now


async def test_kill_collects_unreachable_snapshots(orch, rt, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    await orch.pause(sid)
    await orch.connect(sid, None)
    await orch.pause(sid)
    assert len(store.list_snapshots(kinds=["pause"])) == 2
    await orch.kill(sid)
    assert store.list_snapshots(kinds=["pause"]) == []
    assert store.list_snapshots(kinds=["template"]) != []


async def test_failed_expiry_backs_off(orch, rt, clock, store):
    sid = (await orch.create(CreateRequest(timeout_s=10))).sandbox_id
    clock.advance(11)
    rt.fail["snapshot"] = lambda s: True
    for _ in range(3):
        await orch._ttl.tick()
        await asyncio.sleep(0.05)
    assert len(rt.ops("snapshot")) == 1  # one try, then back off instead of spinning
    assert store.get_sandbox(sid).state is S.RUNNING
    rt.fail.clear()
    orch._ttl._retry_at.clear()
    await orch._ttl.tick()
    await asyncio.sleep(0.05)
    assert store.get_sandbox(sid).state is S.PAUSED


async def test_a_sandbox_s_proxy_state_goes_when_it_ends(orch, rt):
    """What the proxy's routing left (its run event, its coldness) goes at the pause or
    kill that ends the run: nothing per sandbox stays for the service's life."""
    ids = [(await orch.create(CreateRequest())).sandbox_id for _ in range(3)]
    for sid in ids:
        await orch.route(sid, 49983, resume=False)
    ctx = orch._ctx
    assert set(ids) <= set(ctx.activity) and set(ids) <= set(ctx.runs)
    await orch.pause(ids[0])
    await orch.kill(ids[1])
    assert set(ctx.activity) & set(ids) == {ids[2]} and set(ctx.runs) & set(ids) == {ids[2]}
