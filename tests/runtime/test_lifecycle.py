"""NodeRuntime on real QEMU VMs: start from the session template, pause (snapshot stop=True)
and resume (start from the pause snapshot), repeated cycles, a snapshot under disk load, and
the size of incremental memory diffs."""

from __future__ import annotations

import re
import time

import pytest

from host.contract import SnapshotRef
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime

from .conftest import MEM_MB
from .helpers import assert_gone, background, read, run, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

NET = NetworkConfig()
SUDO = "$([ $(id -u) = 0 ] || echo sudo)"


async def test_start_from_template_answers_sdk(runtime: NodeRuntime, template: SnapshotRef) -> None:
    p = await runtime.start("life0", template, NET)
    try:
        print(f"\nstart timings: {p.facts['timings']}")
        assert (await run(p, "echo hello")).split() == ["hello"]
        log = await runtime.console_log("life0", 50)
        assert isinstance(log, list)
        await runtime.update_network("life0", NetworkConfig(allow_internet_access=False))
        assert (await run(p, "echo after-policy")).strip() == "after-policy"
        mem = template.facts["memory"]
        assert mem["base_id"] and template.facts["disk"]["layers"]
        assert template.facts["config_sha256"] and template.facts["machine"]["memory_mb"] == MEM_MB
    finally:
        await runtime.kill("life0")
    await runtime.kill("life0")  # idempotent
    await assert_gone(runtime, "life0")


async def test_pause_resume_keeps_process_and_file(runtime: NodeRuntime,
                                                   template: SnapshotRef) -> None:
    sid = "life1"
    p = await runtime.start(sid, template, NET)
    snaps: list[str] = []
    try:
        pid = await background(p, "sleep 100000")
        await write(p, "/home/user/marker.txt", "before pause")
        await run(p, "echo 0 > /home/user/count; echo inram > /dev/shm/ram")
        for i in range(10):
            t0 = time.perf_counter()
            ref = await runtime.snapshot(sid, f"life1-p{i}", stop=True)
            t_pause = time.perf_counter() - t0
            snaps.append(ref.snapshot_id)
            await assert_gone(runtime, sid)
            t0 = time.perf_counter()
            p = await runtime.start(sid, ref, NET)
            t_resume = time.perf_counter() - t0
            print(f"cycle {i}: pause {t_pause:.2f}s resume {t_resume:.2f}s "
                  f"chain {ref.facts['timings'].get('chain_len')}")
            out = await run(p, f"kill -0 {pid} && echo alive; cat /home/user/count /dev/shm/ram; "
                               "echo $(( $(cat /home/user/count) + 1 )) > /home/user/count")
            assert out.split() == ["alive", str(i), "inram"], out
        assert await read(p, "/home/user/marker.txt") == "before pause"
    finally:
        await runtime.kill(sid)
        for s in snaps:
            await runtime.delete_snapshot(s)
    await assert_gone(runtime, sid)
    # every pause snapshot deleted: their memory dirs are gone too
    left = {d.name for d in runtime.config.memory_dir.iterdir()}
    assert not any(s in left for s in snaps), left


WRITER = r"""
i=0
while :; do
  printf 'rec %08d %s end\n' $i 0123456789abcdef0123456789abcdef0123456789abcdef >> /home/user/log
  sync /home/user/log
  i=$((i+1))
done
"""

BULK = "while :; do dd if=/dev/urandom of=/home/user/big bs=1M count=16 conv=fsync 2>/dev/null; done\n"


async def test_snapshot_under_disk_write_load_is_consistent(runtime: NodeRuntime,
                                                            template: SnapshotRef) -> None:
    sid = "life2"
    p = await runtime.start(sid, template, NET)
    snap = None
    try:
        await write(p, "/home/user/writer.sh", WRITER)
        await background(p, "bash /home/user/writer.sh")
        await write(p, "/home/user/bulk.sh", BULK)
        await background(p, "bash /home/user/bulk.sh")
        await run(p, "sleep 3")
        snap = await runtime.snapshot(sid, "life2-p", stop=True)
        print(f"\nsnapshot under load: {snap.facts['timings']}")
        p = await runtime.start(sid, snap, NET)
        # stop the writers, drop the guest page cache: what we read now comes from the disk
        # layers restored with the snapshot (+ what the writers appended since)
        await run(p, "pkill -f '[w]riter.sh'; pkill -f '[b]ulk.sh'; sleep 0.5; "
                     f"{SUDO} sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'")
        text = await run(p, "cat /home/user/log", timeout=120)
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        assert len(lines) > 5
        pat = re.compile(r"^rec (\d{8}) [0-9a-f]{48} end$")
        for n, line in enumerate(lines[:-1]):  # only the last record may be torn
            m = pat.match(line)
            assert m and int(m.group(1)) == n, (n, line)
    finally:
        await runtime.kill(sid)
        if snap is not None:
            await runtime.delete_snapshot(snap.snapshot_id)
    await assert_gone(runtime, sid)


async def test_incremental_diff_is_about_the_dirtied_memory(runtime: NodeRuntime,
                                                            template: SnapshotRef) -> None:
    sid, k_mib = "life3", 32
    p = await runtime.start(sid, template, NET)
    ids: list[str] = []
    try:
        s1 = await runtime.snapshot(sid, "life3-a", stop=True)
        ids.append(s1.snapshot_id)
        p = await runtime.start(sid, s1, NET)
        await run(p, f"head -c {k_mib}M /dev/urandom > /dev/shm/dirty")
        s2 = await runtime.snapshot(sid, "life3-b", stop=True)
        ids.append(s2.snapshot_id)
        pages = s2.facts["timings"]["diff_pages"]
        mib = pages * 4096 / 2**20
        print(f"\ndirtied {k_mib} MiB -> diff {mib:.1f} MiB (guest RAM {MEM_MB} MiB), "
              f"chain {s2.facts['timings']['chain_len']}")
        assert s2.facts["timings"]["chain_len"] == 2
        assert k_mib * 0.95 <= mib <= k_mib + 24, mib
        p = await runtime.start(sid, s2, NET)
        assert (await run(p, "stat -c %s /dev/shm/dirty")).strip() == str(k_mib << 20)
    finally:
        await runtime.kill(sid)
        for s in ids:
            await runtime.delete_snapshot(s)
    await assert_gone(runtime, sid)


async def test_pause_after_its_source_snapshot_was_deleted(runtime: NodeRuntime,
                                                           template: SnapshotRef) -> None:
    """A sandbox started from a snapshot that is deleted afterwards still pauses and
    resumes: it carries what it boots, and the memory it maps stays while used."""
    p = await runtime.start("srcdel1", template, NET)
    try:
        await write(p, "/home/user/a.txt", "from the source")
        named = await runtime.snapshot("srcdel1", "srcdel-named", stop=False)
        q = await runtime.start("srcdel2", named, NET)
        await runtime.delete_snapshot("srcdel-named")
        assert await runtime.find_snapshot("srcdel-named") is None
        paused = await runtime.snapshot("srcdel2", "srcdel2-p", stop=True)
        q = await runtime.start("srcdel2", paused, NET)
        assert await read(q, "/home/user/a.txt") == "from the source"
    finally:
        for sid in ("srcdel1", "srcdel2"):
            await runtime.kill(sid)
        await runtime.delete_snapshot("srcdel2-p")
    assert not [d for d in runtime.config.memory_dir.iterdir() if d.name.startswith("srcdel")]
