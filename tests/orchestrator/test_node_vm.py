"""The orchestrator with the real node runtime: `python -m host` as a subprocess, driven
through the REST API, the proxy and the e2b SDK; QEMU VMs under TCG.

One service per module (the first create builds the template, ~1-2 min under TCG). The
crash tests SIGKILL the service mid-operation, restart it on the same state and check
that every sandbox is running or paused with its data, that SQLite agrees with the
machine, and that nothing is left behind.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.vmassets import require_vm_assets

from .hostproc import HostService

pytestmark = [pytest.mark.vm, pytest.mark.slow]
ENVD = 49983


def _need_vm() -> None:
    require_vm_assets()


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostService]:
    _need_vm()
    # Not under pytest's basetemp: concurrent pytest runs rotate (delete) old basetemps.
    root = Path(tempfile.mkdtemp(prefix="aenv-orch-vm-", dir="/var/tmp"))
    s = HostService(root)
    try:
        s.start()
        with s.client() as c:  # build the template once for the module
            t0 = time.monotonic()
            r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
            assert r.status_code == 201, r.text
            print(f"\nfirst create (template build + restore): {time.monotonic() - t0:.1f}s")
            c.delete(f"/sandboxes/{r.json()['sandboxID']}")
        yield s
    finally:
        s.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sdk_env(svc: HostService, monkeypatch: pytest.MonkeyPatch) -> HostService:
    monkeypatch.setenv("E2B_API_URL", svc.api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", svc.sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", svc.api_key)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    return svc


def _envd(svc: HostService, sid: str, path: str, token: str | None) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD)}
    if token:
        headers["X-Access-Token"] = token
    return httpx.get(f"{svc.sandbox_url}{path}", headers=headers, timeout=30)


def test_create_token_and_env_vars(sdk_env: HostService) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(envs={"FOO": "bar-42"}, timeout=120)
    try:
        token = sbx._envd_access_token
        assert token
        assert _envd(sdk_env, sbx.sandbox_id, "/envs", None).status_code == 401
        assert _envd(sdk_env, sbx.sandbox_id, "/envs", "wrong").status_code == 401
        r = _envd(sdk_env, sbx.sandbox_id, "/envs", token)
        assert r.status_code == 200 and r.json().get("FOO") == "bar-42"
        res = sbx.commands.run("echo $FOO; whoami; pwd")
        assert res.stdout.split() == ["bar-42", "user", "/home/user"]
        # pause/resume keeps the token: the same SDK handle keeps working
        assert sbx.pause()
        assert Sandbox.connect(sbx.sandbox_id).sandbox_id == sbx.sandbox_id
        assert sbx.commands.run("echo $FOO").stdout.strip() == "bar-42"
    finally:
        sbx.kill()


def test_fork_and_named_snapshot_via_sdk(sdk_env: HostService) -> None:
    from e2b import Sandbox

    parent = Sandbox.create(envs={"E": "1"}, timeout=300)
    made: list[Sandbox] = []
    try:
        parent.files.write("/home/user/state.txt", "before-fork")
        parent.commands.run("sleep 600", background=True)  # a process survives the fork
        kids = parent.fork(count=2, timeout=120)
        made += [k for k in kids if isinstance(k, Sandbox)]
        assert len(made) == 2, kids
        tokens = {parent._envd_access_token, *(k._envd_access_token for k in made)}
        assert len(tokens) == 3 and len({k.sandbox_id for k in made}) == 2
        for i, kid in enumerate(made):
            assert kid.files.read("/home/user/state.txt") == "before-fork"
            assert kid.commands.run("echo $E").stdout.strip() == "1"
            assert "sleep 600" in kid.commands.run("ps -eo args").stdout
            kid.files.write("/home/user/state.txt", f"child-{i}")
        assert parent.files.read("/home/user/state.txt") == "before-fork"  # isolated
        # a named snapshot of a running sandbox, then a new sandbox from it
        snap = parent.create_snapshot("orch-test/snap")
        assert snap.snapshot_id == "orch-test/snap:default"
        assert parent.is_running()
        clone = Sandbox.create(snap.snapshot_id, timeout=120)
        made.append(clone)
        assert clone.files.read("/home/user/state.txt") == "before-fork"
        assert clone._envd_access_token != parent._envd_access_token
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        for sbx in [parent, *made]:
            sbx.kill()


def test_fork_of_a_paused_sandbox_keeps_it_paused(sdk_env: HostService) -> None:
    """A checkpoint kept paused is branched from without a VM of its own: the children
    have its files and processes; it stays paused, then resumes from where it was."""
    from e2b import Sandbox

    parent = Sandbox.create(timeout=300)
    made: list[Sandbox] = []
    try:
        parent.files.write("/home/user/state.txt", "checkpoint")
        parent.commands.run("sleep 600", background=True, timeout=0)
        parent.pause()
        kids = parent.fork(count=2, timeout=120)
        made += [k for k in kids if isinstance(k, Sandbox)]
        assert len(made) == 2, kids
        assert sdk_env.db_states()[parent.sandbox_id] == "paused"
        assert not any(parent.sandbox_id in cmd for cmd in sdk_env.qemu_pids().values())
        for i, kid in enumerate(made):
            assert kid.files.read("/home/user/state.txt") == "checkpoint"
            assert "sleep 600" in kid.commands.run("ps -eo args").stdout
            kid.files.write("/home/user/state.txt", f"child-{i}")
        again = Sandbox.connect(parent.sandbox_id, timeout=300)
        assert again.files.read("/home/user/state.txt") == "checkpoint"  # isolated
        assert "sleep 600" in again.commands.run("ps -eo args").stdout
    finally:
        for sbx in [parent, *made]:
            sbx.kill()


def test_restart_adopts_running_vms(svc: HostService) -> None:
    with svc.client() as c:
        ids = [c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600}).json()[
            "sandboxID"] for _ in range(2)]
        pids = {p for p, cmd in svc.qemu_pids().items() if any(i in cmd for i in ids)}
        assert len(pids) == 2
    assert svc.stop() == 0  # SIGTERM: clean exit, VMs stay for adoption
    assert {p for p, cmd in svc.qemu_pids().items() if any(i in cmd for i in ids)} == pids
    svc.start()
    with svc.client() as c:
        for sid in ids:
            assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"
            r = c.post(f"/sandboxes/{sid}/pause")
            assert r.status_code == 204, r.text  # the adopted VM is fully usable
            c.delete(f"/sandboxes/{sid}")
    _check_consistent(svc)


def _wait_state(c: httpx.Client, sid: str, want: str | None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = c.get(f"/sandboxes/{sid}")
        got = r.json()["state"] if r.status_code == 200 else None
        if got == want:
            return
        time.sleep(0.3)
    raise AssertionError(f"{sid} did not become {want}")


def test_vm_that_dies_is_settled_and_its_streams_end(sdk_env: HostService) -> None:
    """SIGKILL a sandbox's QEMU behind the service's back (what an OOM kill does): the open
    command stream through the proxy ends, and each sandbox is paused on its disk as the
    VM left it (issue 14 item 18): what the guest synced after its last pause is kept, a
    sandbox never paused is not killed; resumes cold-boot that disk; nothing is left."""
    import signal

    from e2b import Sandbox

    fresh = Sandbox.create(timeout=600)
    cycled = Sandbox.create(timeout=600)
    cycled.files.write("/home/user/before.txt", "snapshotted")
    assert cycled.pause()
    cycled = Sandbox.connect(cycled.sandbox_id, timeout=600)
    cycled.files.write("/home/user/after.txt", "kept with the disk")
    fresh.files.write("/home/user/fresh.txt", "never paused")
    for sbx in (fresh, cycled):
        assert sbx.commands.run("sync").exit_code == 0
    bg = fresh.commands.run("sleep 1000", background=True, timeout=0)
    ended = threading.Event()

    def wait() -> None:
        try:
            bg.wait()
        except Exception:  # noqa: BLE001, S110 - any end of the stream will do
            pass
        ended.set()

    threading.Thread(target=wait, daemon=True).start()
    for sbx in (fresh, cycled):
        pids = [p for p, cmd in sdk_env.qemu_pids().items() if sbx.sandbox_id in cmd]
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
    assert ended.wait(30), "the command stream did not end"
    with sdk_env.client() as c:
        _wait_state(c, fresh.sandbox_id, "paused")
        _wait_state(c, cycled.sandbox_id, "paused")
    again = Sandbox.connect(cycled.sandbox_id, timeout=120)
    assert again.files.read("/home/user/before.txt") == "snapshotted"
    assert again.files.read("/home/user/after.txt") == "kept with the disk"
    again.kill()
    first = Sandbox.connect(fresh.sandbox_id, timeout=120)
    assert first.files.read("/home/user/fresh.txt") == "never paused"
    first.kill()
    assert fresh.sandbox_id not in sdk_env.vm_sandbox_ids()
    assert fresh.sandbox_id not in sdk_env.netns()


def test_vm_that_died_while_the_service_was_down_keeps_its_disk(
        sdk_env: HostService) -> None:
    """The service is SIGKILLed, then the sandbox's QEMU: at restart, recovery finds the
    VM gone but its disk in the block server, and pauses the sandbox on it (issue 14
    item 18) instead of killing it (it was never paused)."""
    import signal

    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600)
    sid = sbx.sandbox_id
    sbx.files.write("/home/user/survivor.txt", "written before both crashes")
    assert sbx.commands.run("sync").exit_code == 0
    pids = [p for p, cmd in sdk_env.qemu_pids().items() if sid in cmd]
    assert len(pids) == 1
    sdk_env.sigkill()
    os.kill(pids[0], signal.SIGKILL)
    sdk_env.start()
    with sdk_env.client() as c:
        _wait_state(c, sid, "paused")
    again = Sandbox.connect(sid, timeout=120)
    assert again.files.read("/home/user/survivor.txt") == "written before both crashes"
    again.kill()
    assert sid not in sdk_env.vm_sandbox_ids() and sid not in sdk_env.netns()


def test_ttl_expiry_pauses_by_default_and_kills_without_autopause(svc: HostService) -> None:
    with svc.client() as c:
        p = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3}).json()
        k = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3,
                                          "autoPause": False}).json()
        _wait_state(c, p["sandboxID"], "paused")
        _wait_state(c, k["sandboxID"], None)  # 404 from `killing` on
        deadline = time.monotonic() + 60
        while svc.db_states()[k["sandboxID"]] != "killed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert svc.db_states()[k["sandboxID"]] == "killed"
        assert k["sandboxID"] not in svc.vm_sandbox_ids()
        # a pause answers once the guest is stopped; its VM goes when the snapshot is
        # committed, which a loaded machine may not have finished yet
        while p["sandboxID"] in svc.vm_sandbox_ids() and time.monotonic() < deadline + 60:
            time.sleep(0.2)
        assert p["sandboxID"] not in svc.vm_sandbox_ids()
        r = c.post(f"/v2/sandboxes/{p['sandboxID']}/connect", json={"timeout": 60})
        assert r.status_code == 201
        c.delete(f"/sandboxes/{p['sandboxID']}")


def test_load_20_creates_and_20_pauses(svc: HostService) -> None:
    n = 20
    with svc.client(timeout_s=600) as c, cf.ThreadPoolExecutor(n) as pool:
        t0 = time.monotonic()
        created = list(pool.map(lambda _: c.post("/v2/sandboxes", json={
            "templateID": "base", "timeout": 600}), range(n)))
        t_create = time.monotonic() - t0
        failed = [r.text for r in created if r.status_code != 201]
        print(f"\nload: {n} concurrent creates {time.monotonic() - t0:.1f}s")
        assert failed == [], failed
        ids = [r.json()["sandboxID"] for r in created]
        t0 = time.monotonic()
        paused = list(pool.map(lambda sid: c.post(f"/sandboxes/{sid}/pause"), ids))
        t_pause = time.monotonic() - t0
        assert [r.text for r in paused if r.status_code != 204] == []
        print(f"\nload: {n} concurrent creates {t_create:.1f}s, {n} concurrent pauses "
              f"{t_pause:.1f}s")
        list(pool.map(lambda sid: c.delete(f"/sandboxes/{sid}"), ids))
    assert not (set(ids) & svc.vm_sandbox_ids())


def _write(svc: HostService, info: dict, text: str) -> None:
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    sbx = Sandbox.connect(info["sandboxID"])
    for attempt in range(3):
        try:
            sbx.files.write("/home/user/data.txt", text)
            return
        except SandboxException as exc:  # seen once after a restart: connection reset
            print(f"\nwrite to {info['sandboxID']} failed (attempt {attempt + 1}): {exc}")
            time.sleep(1)
    sbx.files.write("/home/user/data.txt", text)


def _read(info: dict) -> str:
    from e2b import Sandbox

    sbx = Sandbox.connect(info["sandboxID"], timeout=120)
    return sbx.files.read("/home/user/data.txt")


def _check_consistent(svc: HostService) -> tuple[dict[str, str], set[str]]:
    """SQLite agrees with the machine. Returns (states, ids of orphan QEMU processes)."""
    states = svc.db_states()
    assert set(states.values()) <= {"running", "paused", "killed"}, states
    running = {sid for sid, st in states.items() if st == "running"}
    vms = svc.vm_sandbox_ids()
    assert running <= vms  # no lost VM
    orphans = vms - running
    assert len(svc.qemu_pids()) == len(vms)
    assert svc.vm_dirs() <= running  # sockets / work dirs only for live VMs
    ns = svc.netns()
    if ns or running:
        assert ns in (set(), running) or ns == running, (ns, running)
    assert svc.mounts() == []
    return states, orphans


def test_crash_right_after_a_pause_answer_loses_nothing(sdk_env: HostService) -> None:
    """A pause is answered once the guest is stopped and committed after. A service
    killed in between leaves the sandbox `pausing` with its VM stopped: recovery adopts
    that VM and finishes the pause, so memory (a running process, 96 MiB it dirtied) and
    disk come back on resume."""
    from e2b import Sandbox

    svc = sdk_env
    sbx = Sandbox.create(timeout=600)
    sid = sbx.sandbox_id
    sbx.files.write("/home/user/data.txt", "kept")
    digest = sbx.commands.run("head -c 96M /dev/urandom > /dev/shm/big && "
                              "sha256sum /dev/shm/big | cut -d' ' -f1").stdout.strip()
    pid = sbx.commands.run("sleep 100000", background=True).pid
    assert sbx.pause()
    at_kill = svc.db_states()[sid]
    svc.sigkill()
    print(f"\nstate at SIGKILL, right after the pause's answer: {at_kill}")
    svc.start()
    try:
        assert svc.db_states()[sid] == "paused"
        again = Sandbox.connect(sid, timeout=120)
        assert again.files.read("/home/user/data.txt") == "kept"
        assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        out = again.commands.run("sha256sum /dev/shm/big | cut -d' ' -f1").stdout.strip()
        assert out == digest
        again.kill()
    except AssertionError:
        print(svc.log(20000))
        raise
    _check_consistent(svc)


@pytest.mark.parametrize("delay_s", [0.3, 0.8, 1.5])
def test_crash_during_create_pause_resume_fork(sdk_env: HostService, delay_s: float) -> None:
    svc = sdk_env
    with svc.client() as c:
        def create() -> dict:
            r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r.status_code == 201, r.text
            return r.json()

        to_pause, to_resume, to_fork = create(), create(), create()
        for info, text in ((to_pause, "p"), (to_resume, "r"), (to_fork, "f")):
            _write(svc, info, f"data-{text}")
        assert c.post(f"/sandboxes/{to_resume['sandboxID']}/pause").status_code == 204
        before = {sid for sid, st in svc.db_states().items() if st != "killed"}

        def fire(method: str, url: str, body: dict | None = None) -> None:
            try:
                with svc.client(timeout_s=60) as c2:
                    c2.request(method, url, json=body)
            except httpx.HTTPError:
                pass  # the service dies under it

        calls = [("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 600}),
                 ("POST", f"/sandboxes/{to_pause['sandboxID']}/pause", {}),
                 ("POST", f"/v2/sandboxes/{to_resume['sandboxID']}/connect", {"timeout": 600}),
                 ("POST", f"/sandboxes/{to_fork['sandboxID']}/fork", {"count": 2})]
        threads = [threading.Thread(target=fire, args=a) for a in calls]
        for t in threads:
            t.start()
        time.sleep(delay_s)
        mid = svc.db_states()
        svc.sigkill()
        for t in threads:
            t.join(60)
        print(f"\nstates at SIGKILL (+{delay_s}s): "
              f"{sorted(st for sid, st in mid.items() if st != 'killed')}")

    svc.start()
    try:
        states, orphans = _check_consistent(svc)
    except AssertionError:
        print(svc.log(20000))
        raise
    for sid in before:
        assert states[sid] in ("running", "paused"), (sid, states[sid])
    for info, text in ((to_pause, "p"), (to_resume, "r"), (to_fork, "f")):
        assert _read(info) == f"data-{text}"
    with svc.client() as c:
        for sid, st in svc.db_states().items():
            if st != "killed":
                assert c.delete(f"/sandboxes/{sid}").status_code == 204
    _, left = _check_consistent(svc)
    creating = svc.recovered_from("creating")
    if orphans or left:
        # Known host.runtime gap: QemuProcess.spawn writes <vm dir>/pid only after QMP
        # connects, so a service killed in that window leaves a QEMU that kill()/
        # reap_orphans() cannot find (the orchestrator did ask for it: creating -> kill).
        assert orphans | left <= creating, (orphans, left, creating)
        for pid in svc.qemu_pids():  # end it here so the next test starts clean
            os.kill(pid, 9)
        pytest.xfail(f"runtime left QEMU of sandboxes killed while creating: {orphans | left}")


def test_a_sandbox_paused_a_hundred_times_keeps_short_chains(sdk_env: HostService) -> None:
    """Paused and resumed 100 times, each time after a write: the memory diff chain stays
    within its bound (8), and the disk chain too (`max_disk_chain` 8: the sandbox's own
    layers are merged in the background). Once collected (`aenv gc`, the real CLI and
    route), only the pause it resumes from is left of its pauses; a resume (a restore: the
    module's service keeps no paused VM) reads a bounded number of memory files and disk
    layers, with its data and processes intact."""
    svc = sdk_env
    rounds = 100
    manifests = svc.state / "repo" / "manifests"
    with svc.client(timeout_s=300) as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 3600})
        assert r.status_code == 201, r.text
        info = r.json()
        sid = info["sandboxID"]

        def ours() -> list[dict]:
            docs = [json.loads(p.read_text()) for p in manifests.glob("snapshot-*.json")]
            return sorted((d for d in docs if d.get("sandbox_id") == sid),
                          key=lambda d: d["created_at"])

        def chains(m: dict) -> tuple[int, int]:
            """(disk layers of its own, memory diffs) a restore of `m` opens, beside the
            template's layers and the memory base's files."""
            return len(m["disk"]["layers"]) - m["disk"]["base"], len(m["memory"]["diffs"])

        def newest(after: float) -> dict:
            """The sandbox's newest pause (its commit follows the 204)."""
            deadline = time.monotonic() + 120
            while not (docs := [d for d in ours() if d["created_at"] > after]):
                assert time.monotonic() < deadline, "the pause was never committed"
                time.sleep(0.1)
            return docs[-1]

        try:
            from e2b import Sandbox

            sbx = Sandbox.connect(sid)
            sbx.commands.run("sleep 100000", background=True)  # a process a resume keeps
            seen: list[tuple[int, int]] = []
            t0 = time.monotonic()
            for i in range(rounds):
                _write(svc, info, f"round {i}")
                asked = time.time()
                assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
                seen.append(chains(newest(asked)))
                assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 3600}
                              ).status_code in (200, 201)
            print(f"\n{rounds} pause/resume rounds in {time.monotonic() - t0:.0f}s; own disk "
                  f"layers per pause {[d for d, _ in seen]}; memory diffs per pause "
                  f"{[m for _, m in seen]}")
            assert max(d for d, _ in seen) <= 2 * 8  # merges run behind pauses, never far
            assert max(d for d, _ in seen[-10:]) <= 8 + 1
            assert max(m for _, m in seen) <= 8  # max_chain
            before = len(ours())
            env = {**os.environ, "AENV_API_URL": svc.api_url, "E2B_API_KEY": svc.api_key}
            out = subprocess.run([sys.executable, "-m", "host.cli", "gc", "--output", "json"],
                                 env=env, capture_output=True, text=True, timeout=300,
                                 check=False)
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            left = ours()
            print(f"{before} manifests of this sandbox -> {len(left)} after gc "
                  f"({report['records']['snapshots']} snapshots collected)")
            assert len(left) == 1
            assert _read(info) == f"round {rounds - 1}"
            asked = time.time()
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
            last = newest(asked)
            disk, diffs = chains(last)
            print(f"the resume reads {len(last['disk']['layers'])} disk layers ({disk} of "
                  f"its own) and {len(last['memory']['files'])} memory files ({diffs} diffs)")
            assert disk <= 8 + 1 and diffs <= 8
            assert c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}
                          ).status_code in (200, 201)
            assert _read(info) == f"round {rounds - 1}"
            ps = Sandbox.connect(sid).commands.run("pgrep -f '^sleep 100000'", timeout=60)
            assert ps.stdout.strip(), "the process started before the pauses is gone"
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_a_crash_during_a_collection_loses_nothing(sdk_env: HostService) -> None:
    """SIGKILL of the service while a collection runs, then a restart: the paused and the
    running sandbox keep everything they need, and the next collection takes what the
    cut one left (no layer file is left that nothing names). Last of the module: it runs
    the service with --gc-min-age 0."""
    svc = sdk_env
    with svc.client(timeout_s=300) as c:
        made = [c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600}).json()
                for _ in range(3)]
        paused, running, doomed = made
        for info, text in zip(made, ("paused data", "running data", "x")):
            _write(svc, info, text)
        for _ in range(3):  # garbage: the doomed sandbox's pauses, its layers after its kill
            assert c.post(f"/sandboxes/{doomed['sandboxID']}/pause").status_code == 204
            assert c.post(f"/sandboxes/{doomed['sandboxID']}/connect",
                          json={"timeout": 600}).status_code in (200, 201)
            _write(svc, doomed, "more")
        c.delete(f"/sandboxes/{doomed['sandboxID']}")
        assert c.post(f"/sandboxes/{paused['sandboxID']}/pause").status_code == 204
    svc.stop()
    svc.extra += ["--gc-min-age", "0"]
    svc.start()
    layers = svc.state / "storage" / "layers"
    before = sum(1 for _ in os.scandir(layers))

    def collect() -> None:
        with svc.client(timeout_s=60) as c, contextlib.suppress(httpx.HTTPError):
            c.post("/admin/gc")

    # garbage enough that the sweep takes a while: the cut lands in it, not before or after
    fake = [layers / f"{os.urandom(32).hex()}.lsmt" for _ in range(20000)]
    for f in fake:
        f.write_bytes(b"junk")
    planted = sum(1 for _ in os.scandir(layers))
    t = threading.Thread(target=collect)
    t.start()
    while t.is_alive() and sum(1 for _ in os.scandir(layers)) >= planted:
        time.sleep(0.002)
    svc.sigkill()  # the sweep has begun
    t.join()
    cut = sum(f.exists() for f in fake)
    print(f"\nthe service was killed with {cut} of {len(fake)} junk layers left")
    assert 0 < cut < len(fake), "the kill did not land in the middle of the sweep"
    svc.start()
    with svc.client(timeout_s=300) as c:
        report = c.post("/admin/gc").json()
        assert not any(f.exists() for f in fake)  # the next collection took the rest
        assert c.post(f"/sandboxes/{paused['sandboxID']}/connect",
                      json={"timeout": 600}).status_code in (200, 201)
        assert _read(paused) == "paused data"
        assert _read(running) == "running data"
        named = set()
        for doc in (svc.state / "repo" / "manifests").glob("*.json"):
            named |= {d.split(":")[-1] for d in _layers_of(json.loads(doc.read_text()))}
        for stack in (svc.state / "storage" / "stacks").glob("*.json"):
            named |= {d.split(":")[-1] for d in json.loads(stack.read_text())["layers"]}
        left = {p.stem for p in layers.glob("*.lsmt")}
        print(f"\nlayers: {before} before the cut collection, {len(left)} after the next "
              f"({report['storage']['layers']['files']} taken by it)")
        assert left <= named | _image_layers(svc), left - named
        for info in (paused, running):
            c.delete(f"/sandboxes/{info['sandboxID']}")


def _layers_of(doc: object) -> set[str]:
    from host.runtime.collect import named_layers
    return set(named_layers(doc))


def _image_layers(svc: HostService) -> set[str]:
    cache = svc.state / "layers.json"
    return ({str(v).split(":")[-1] for v in json.loads(cache.read_text()).values()}
            if cache.exists() else set())
