"""Memory pressure (host/orchestrator/pressure.py, host/hostmem.py): what the node has left is
the smaller of MemAvailable and its memory cgroup's room (v1 or v2, any ancestor); below
the low mark the coldest running sandboxes are paused, one at a time, until the high
mark is available again; the fake runtime stands in for VMs (the real thing is
tests/e2e/test_memory_pressure.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.hostmem import cgroup_available_mib
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import CreateRequest
from host.orchestrator.pressure import PressureGuard, PressurePolicy
from host.orchestrator.states import SandboxState as S

MIB = 1024 * 1024
on_loop = pytest.mark.asyncio(loop_scope="function")


def _cg(d: Path, files: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_cgroup_v1_limit_with_unmapped_cache(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cg(root / "memory", {"memory.limit_in_bytes": str(1 << 63), "memory.usage_in_bytes": "0",
                          "memory.stat": "total_cache 0\n"})
    _cg(root / "memory/svc", {"memory.limit_in_bytes": str(2048 * MIB),
                              "memory.usage_in_bytes": str(1800 * MIB),
                              "memory.stat": f"total_cache {300 * MIB}\n"
                                             f"total_mapped_file {200 * MIB}\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/svc\n0::/\n")
    # the page cache no process maps is free to take; the mapped part (VM RAM files) not
    assert cgroup_available_mib(proc, root) == 2048 - 1800 + 100


def test_cgroup_v2_the_tightest_ancestor_counts(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cg(root / "a", {"memory.max": str(1000 * MIB), "memory.current": str(900 * MIB),
                     "memory.stat": "file 0\nfile_mapped 0\n"})
    _cg(root / "a/b", {"memory.max": "max", "memory.current": str(900 * MIB),
                       "memory.stat": "file 0\nfile_mapped 0\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_available_mib(proc, root) == 100
    proc.write_text("0::/\n")
    assert cgroup_available_mib(proc, root) is None  # no limit anywhere
    assert cgroup_available_mib(tmp_path / "missing", root) is None


def make(store, rt, envd) -> NodeOrchestrator:
    return NodeOrchestrator(store, rt, domain="sbx.test",
                            envd=EnvdClient(transport=envd.transport()))


@on_loop
async def test_pauses_the_coldest_until_the_high_mark(store, rt, envd) -> None:
    o = make(store, rt, envd)
    await o.start(ttl_interval_s=3600)
    try:
        ids = [(await o.create(CreateRequest())).sandbox_id for _ in range(4)]
        # requests reach sandboxes 0, 2 and 3 (in that order) through the proxy: 1 is
        # the coldest, then 0, then 2
        for i in (0, 2, 3):
            await o.route(ids[i], 49983, resume=False)
        assert await o.coldest_running() == [ids[1], ids[0], ids[2], ids[3]]

        available = {"mib": 5000}
        guard = PressureGuard(o, PressurePolicy(low_mib=1000, high_mib=1500),
                              available_mib=lambda: available["mib"])
        assert await guard.tick() == []  # plenty left: nothing paused

        real_pause = o.pause_for_memory

        async def pause_and_free(sid: str) -> None:  # each pause gives back 300 MiB
            await real_pause(sid)
            available["mib"] += 300

        o.pause_for_memory = pause_and_free  # type: ignore[method-assign]
        available["mib"] = 900
        assert await guard.tick() == [ids[1], ids[0]]  # 900 -> 1200 -> 1500: enough
        states = {r.id: r.state for r in store.list_sandboxes()}
        assert [states[i] for i in ids] == [S.PAUSED, S.PAUSED, S.RUNNING, S.RUNNING]

        # a sandbox that cannot be paused is skipped, the next coldest goes instead
        available["mib"] = 900
        rt.fail["snapshot"] = lambda sid: sid == ids[2]
        assert await guard.tick() == [ids[3]]
        rt.fail.clear()
        assert store.get_sandbox(ids[2]).state is S.RUNNING  # its failed pause undone
        assert guard.paused == [ids[1], ids[0], ids[3]]
        # paused sandboxes keep everything: a request resumes the coldest one
        await o.connect(ids[1], None)
        assert store.get_sandbox(ids[1]).state is S.RUNNING
    finally:
        await o.aclose()


@on_loop
async def test_idle_sandboxes_balloons_go_before_any_pause(store, rt, envd) -> None:
    """Below the low mark the coldest sandboxes' balloons are inflated first, each by its
    guest's page cache, at most what it reports it can spare less a headroom; none is
    paused when that is enough.
    A sandbox that gets a request again is deflated at the next tick."""
    o = make(store, rt, envd)
    await o.start(ttl_interval_s=3600)
    try:
        ids = [(await o.create(CreateRequest())).sandbox_id for _ in range(4)]
        await o.route(ids[3], 49983, resume=False)  # the hottest
        rt.spare = {ids[0]: 400, ids[1]: 300, ids[2]: 500, ids[3]: 900}  # ids[3] not needed
        rt.caches = {ids[1]: 36}  # the rest of ids[1]'s is free memory: not asked for
        available = {"mib": 900}
        real_set = rt.set_balloon

        async def set_and_free(sid: str, mib: int) -> None:  # the host gets it back
            available["mib"] += mib - rt.balloons.get(sid, 0)
            await real_set(sid, mib)

        rt.set_balloon = set_and_free  # type: ignore[method-assign]
        guard = PressureGuard(o, PressurePolicy(low_mib=1000, high_mib=1500),
                              available_mib=lambda: available["mib"])
        assert await guard.tick() == []  # 600 MiB asked: the balloons gave it, no pause
        # coldest first: 400 - 64, then ids[1]'s cache, then the rest of 600 from the third
        assert rt.balloons == {ids[0]: 336, ids[1]: 36, ids[2]: 228}
        assert available["mib"] == 1500
        assert {r.state for r in store.list_sandboxes()} == {S.RUNNING}
        assert o.service_metrics.balloon_bytes._value.get() == 600 * MIB
        assert o.service_metrics.balloon_sandboxes._value.get() == 3

        # a request reaches ids[0]: its balloon goes at the next tick, the others stay
        await o.route(ids[0], 49983, resume=False)
        assert await guard.tick() == []
        assert rt.balloons == {ids[0]: 0, ids[1]: 36, ids[2]: 228}
        assert set(o.balloons.inflated) == {ids[1], ids[2]}

        # guests with nothing left to spare: pausing is the last resort, as before
        rt.spare = {}
        available["mib"] = 900
        rt.fail["set_balloon"] = lambda sid: True
        paused = await guard.tick()
        assert paused and paused[0] == ids[1]  # the coldest
        # a paused sandbox's balloon is forgotten (its restore starts deflated)
        rt.fail.clear()
        available["mib"] = 2000
        await guard.tick()
        assert not set(o.balloons.inflated) & set(paused)
    finally:
        await o.aclose()
