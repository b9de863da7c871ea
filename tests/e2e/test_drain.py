"""The stop-time drain on a real service (`--drain-on-stop`, issue 35 item 1), as a
container deploy runs it: the VMs die with the service, so SIGTERM pauses every running
sandbox with its memory first, and the next start resumes them.

- 10 running sandboxes (a file each, a background process each, one serving HTTP through
  the proxy): SIGTERM, the service exits with no VM, network namespace or stack left;
  restarted, every sandbox runs again by itself, with its file, its process and its
  server. The drain's time is printed.
- SIGKILL mid-drain, the VMs killed with it (a container's end): after the restart every
  sandbox either runs (its pause was committed) or is paused with its disk (recovery
  salvaged it); none is lost, each has its file once resumed.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from . import fleet as fleet_of
from .conftest import E2EService, private_service, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]


@pytest.fixture(scope="module")
def draining() -> Iterator[E2EService]:
    with private_service("aedrn", prefix="aedrn-", pool="10.216.144.0/20",
                         extra=["--drain-on-stop"]) as s:
        yield s


def _wait_states(s: E2EService, ids: list[str], ok: set[str], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = s.db_states()
        if all(states.get(sid) in ok for sid in ids):
            return
        assert time.monotonic() < deadline, (states, s.log())
        time.sleep(0.5)


def _kill_vms(s: E2EService) -> None:
    for pid in s.qemu_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_drained_node_restarts_with_every_sandbox_running(
        draining: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(draining, monkeypatch)
    fleet = fleet_of.make(draining, 10)
    ids = fleet.ids

    t0 = time.monotonic()
    assert draining.stop(timeout_s=600) == 0
    drain_s = time.monotonic() - t0
    log = draining.log(500_000)
    m = re.search(r"drain: (\d+) sandboxes paused, (\d+) failed", log)
    assert m and m.group(1, 2) == ("10", "0"), log[-4000:]
    print(f"\ndrain of 10 running sandboxes: {drain_s:.1f} s from SIGTERM to exit")
    assert draining.qemu_pids() == {} and draining.netns() == set()
    assert draining.vm_dirs() == set()
    states = draining.db_states()
    assert all(states[sid] == "paused" for sid in ids), states

    draining.start()
    t1 = time.monotonic()
    _wait_states(draining, ids, {"running"})
    print(f"the next start resumed all 10 in {time.monotonic() - t1:.1f} s")
    fleet_of.check_resumed(fleet)
    for sid in ids:
        Sandbox.kill(sid)


def test_a_node_killed_mid_drain_loses_no_sandbox(
        draining: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    use_sdk(draining, monkeypatch)
    ids = fleet_of.with_files(6)
    proc = draining.proc
    assert proc is not None
    mark = len(draining.log(10_000_000))
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 600
    while "drain: sandbox" not in draining.log(10_000_000)[mark:]:
        assert time.monotonic() < deadline and proc.poll() is None, draining.log()
        time.sleep(0.05)
    draining.sigkill()  # mid-drain: some paused, some not
    _kill_vms(draining)  # a container's VMs die with it
    draining.start()
    _wait_states(draining, ids, {"running", "paused"})
    states = draining.db_states()
    print(f"\nafter a SIGKILL mid-drain: {sorted(states[sid] for sid in ids)}")
    fleet_of.check_files_and_kill(ids)
