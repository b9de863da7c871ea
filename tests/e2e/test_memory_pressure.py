"""The memory-pressure policy on real VMs (host/orchestrator/pressure.py): the service
runs in a memory cgroup (v1 here, v2 where the host has it) that its sandboxes outgrow
when one of them allocates; the policy pauses running sandboxes coldest first before
the cgroup's OOM killer acts, and each paused sandbox resumes with its processes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import E2EService, need_vm, private_service, use_sdk

MIB = 1024 * 1024
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """A fresh memory cgroup (v1 or v2) and the wrapper that starts a process in it."""

    def __init__(self, name: str) -> None:
        if (V2 / "cgroup.controllers").exists() and "memory" in (
                V2 / "cgroup.subtree_control").read_text().split():
            self.dir, self.v2 = V2 / name, True
        elif V1.is_dir():
            self.dir, self.v2 = V1 / name, False
        else:
            pytest.skip("no memory cgroup controller (v1 or v2) on this host")
        self.dir.mkdir()

    @property
    def wrapper(self) -> list[str]:
        return ["sh", "-c", f'echo $$ > {self.dir}/cgroup.procs && exec "$@"', "sh"]

    def usage(self) -> int:
        return int((self.dir / ("memory.current" if self.v2 else
                                "memory.usage_in_bytes")).read_text())

    def in_use(self) -> int:
        """Usage less the page cache nobody maps (what the kernel drops before an OOM)."""
        stat = dict(line.split() for line in (self.dir / "memory.stat").read_text().splitlines())
        cache, mapped = (int(stat[k]) for k in (("file", "file_mapped") if self.v2 else
                                                 ("total_cache", "total_mapped_file")))
        return self.usage() - max(0, cache - mapped)

    def limit(self, n: int) -> None:
        (self.dir / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(n))

    def oom_kills(self) -> int:
        text = (self.dir / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        m = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(m.group(1)) if m else 0

    def remove(self) -> None:
        # and the same path in the other v1 controllers: the VM jail made its cgroups
        # under the service's (host/vmm/jail/cgroup.py), and removes only its VMs' own
        dirs = [self.dir] if self.v2 else [c / self.dir.name for c in V1.parent.iterdir()
                                            if (c / self.dir.name).is_dir()]
        for d in dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.2)


@pytest.fixture
def squeezed() -> Iterator[tuple[E2EService, MemoryCgroup]]:
    need_vm()
    cg = MemoryCgroup(f"aenv-pressure-{os.getpid()}")
    try:
        with private_service("aepr", prefix="aepr-", pool="10.216.80.0/20",
                             extra=["--memory-pressure-mib", "256",
                                    "--memory-reserve-mib", "64"],
                             memory_mb=768, wrapper=cg.wrapper) as s:
            yield s, cg
    finally:
        cg.remove()


def test_the_coldest_sandboxes_are_paused_instead_of_an_oom_kill(
        squeezed: tuple[E2EService, MemoryCgroup], monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    svc, cg = squeezed
    use_sdk(svc, monkeypatch)
    a, b, c = (Sandbox.create(timeout=600) for _ in range(3))
    # requests reach b, then c, then a: b is the coldest, a the hottest
    for sbx in (b, c, a):
        sbx.files.write("/home/user/mark", sbx.sandbox_id)
    # room for what runs now plus 400 MiB: then a allocates 450 MiB in its guest
    cg.limit(cg.in_use() + 400 * MIB)
    hog = a.commands.run(
        "python3 -c 'import time; b = bytearray(450 << 20); b[::4096] = b\"x\" * len(b[::4096]);"
        " print(\"held\", flush=True); time.sleep(3600)'", background=True)
    deadline = time.monotonic() + 180
    paused: list[str] = []
    while time.monotonic() < deadline:
        paused = re.findall(r"memory pressure: .* paused (\S+), the coldest", svc.log(200_000))
        if b.sandbox_id in paused and c.sandbox_id in paused:
            break
        time.sleep(1)
    assert paused[:2] == [b.sandbox_id, c.sandbox_id], paused  # coldest first
    assert cg.oom_kills() == 0
    assert svc.proc is not None and svc.proc.poll() is None  # the service lives
    assert Sandbox.get_info(b.sandbox_id).state.value == "paused"
    # every paused sandbox resumes with what it had; the hog is still holding its memory
    # (a may have been paused too, if pausing b and c was not enough)
    cg.limit(cg.in_use() + 4096 * MIB)
    for sbx in (b, c, a):
        again = Sandbox.connect(sbx.sandbox_id, timeout=600)
        assert again.files.read("/home/user/mark") == sbx.sandbox_id
    assert hog.pid in [p.pid for p in Sandbox.connect(a.sandbox_id).commands.list()]
    for sbx in (a, b, c):
        sbx.kill()
