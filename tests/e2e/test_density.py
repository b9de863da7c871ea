"""Overcommit on real VMs: 40 idle 512 MiB sandboxes from one template fit on this
machine with room to spare. Their guests are promised 20 GiB; what they cost the host
(the PSS of their VMMs: copy-on-write pages of the shared template memory, QEMU itself,
and under TCG its translated code) is a fraction of it, the host keeps most of its memory
available, and every sandbox still answers."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.conftest import E2EService, private_service, use_sdk

N = 40
MEM_MIB = 512


def _pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError(f"no Pss for {pid}")


def _available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemAvailable")


@pytest.fixture
def service512() -> Iterator[E2EService]:
    with private_service("aeds", prefix="aeds-", pool="10.216.96.0/20",
                         extra=["--max-starts", "2"], memory_mb=MEM_MIB) as s:
        yield s


def test_forty_idle_sandboxes_fit_with_room_to_spare(service512: E2EService,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(service512, monkeypatch)
    total_mib = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    boxes: list = []
    try:
        with ThreadPoolExecutor(4) as pool:
            boxes = list(pool.map(lambda _: Sandbox.create(timeout=900), range(N)))
        pids = service512.qemu_pids()
        assert len(pids) == N
        pss_mib = sum(_pss_kib(pid) for pid in pids) / 1024
        promised_mib = N * MEM_MIB
        print(f"\n{N} idle sandboxes: {promised_mib} MiB promised, VMM PSS {pss_mib:.0f} MiB "
              f"({promised_mib / pss_mib:.1f}x), host MemAvailable {_available_mib()} of "
              f"{total_mib} MiB")
        # the guests are promised more than the host has; they cost it a fraction of that
        assert promised_mib / pss_mib >= 4
        assert _available_mib() >= total_mib // 2  # room to spare
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda b: b.commands.run("echo $((6 * 7))").stdout, boxes))
        assert outs == ["42\n"] * N
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda b: b.kill(), boxes))
