"""`Metrics` and the scrape-time collectors, without a service: operation timing (success,
failure, nesting, cancellation), one registry per instance, sources read at each scrape
(and left out when they fail), the PSS reader, the storage sums."""

from __future__ import annotations

import asyncio
import os

import pytest

from host.metrics import OPERATIONS, CacheUsage, Metrics, StorageUsage, Transfer, pss_bytes
from host.metrics.logs import current_sandbox

from .scrape import Scrape, parse


async def render(m: Metrics) -> Scrape:
    return parse((await m.render()).decode())


async def test_every_operation_series_exists_from_the_start() -> None:
    page = await render(Metrics())
    assert page.types["aenv_sandbox_operation_seconds"] == "histogram"
    for op in OPERATIONS:
        assert page.value("aenv_sandbox_operation_seconds_count", operation=op) == 0
    assert page.value("aenv_proxy_bytes_total", direction="in") == 0
    assert page.value("aenv_proxy_bytes_total", direction="out") == 0


async def test_operation_times_successes_and_counts_failures_by_class() -> None:
    m = Metrics()
    before = await render(m)
    with m.operation("pause", "i" + "a" * 20):
        assert current_sandbox() == "i" + "a" * 20
    assert current_sandbox() is None
    with pytest.raises(KeyError), m.operation("pause"):
        raise KeyError("boom")
    after = await render(m)
    assert after.delta(before, "aenv_sandbox_operation_seconds_count", operation="pause") == 1
    assert after.delta(before, "aenv_sandbox_operation_seconds_count") == 1
    assert after.value("aenv_sandbox_operation_errors_total", operation="pause",
                       error="KeyError") == 1
    assert after.value("aenv_sandbox_operation_seconds_sum", operation="pause") < 1


async def test_nested_scopes_of_one_operation_count_once() -> None:
    m = Metrics()
    with m.operation("pause", "i" + "b" * 20), m.operation("pause", "i" + "c" * 20):
        assert current_sandbox() == "i" + "b" * 20  # the inner scope is a no-op
        with m.operation("kill"):  # another operation is timed on its own
            pass
    with pytest.raises(ValueError), m.operation("fork"), m.operation("fork"):
        raise ValueError
    page = await render(m)
    assert page.value("aenv_sandbox_operation_seconds_count", operation="pause") == 1
    assert page.value("aenv_sandbox_operation_seconds_count", operation="kill") == 1
    assert page.total("aenv_sandbox_operation_errors_total", operation="fork") == 1


async def test_a_cancelled_operation_counts_as_neither() -> None:
    m = Metrics()
    started = asyncio.Event()

    async def op() -> None:
        with m.operation("resume"):
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(op())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    page = await render(m)
    assert page.value("aenv_sandbox_operation_seconds_count", operation="resume") == 0
    assert page.total("aenv_sandbox_operation_errors_total") == 0


async def test_operation_scopes_of_concurrent_tasks_are_separate() -> None:
    m = Metrics()
    seen: dict[str, str | None] = {}

    async def op(sid: str) -> None:
        with m.operation("pause", sid):  # not nested: each task has its own context
            await asyncio.sleep(0.01)
            seen[sid] = current_sandbox()

    sids = ["i" + c * 20 for c in "xyz"]
    await asyncio.gather(*(op(s) for s in sids))
    assert seen == {s: s for s in sids}
    assert (await render(m)).value("aenv_sandbox_operation_seconds_count",
                                   operation="pause") == 3


async def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    with a.operation("create"):
        pass
    assert (await render(a)).value("aenv_sandbox_operation_seconds_count",
                                   operation="create") == 1
    assert (await render(b)).value("aenv_sandbox_operation_seconds_count",
                                   operation="create") == 0


async def test_sandbox_states_are_read_at_each_scrape() -> None:
    m = Metrics()
    counts = {"running": 2, "paused": 0}
    reads = 0

    async def read() -> dict[str, int]:
        nonlocal reads
        reads += 1
        return dict(counts)

    m.track_sandboxes(read)
    first = await render(m)
    counts.update(running=1, paused=1)
    second = await render(m)
    assert reads == 2
    assert first.types["aenv_sandboxes"] == "gauge"
    assert (first.value("aenv_sandboxes", state="running"),
            first.value("aenv_sandboxes", state="paused")) == (2, 0)
    assert (second.value("aenv_sandboxes", state="running"),
            second.value("aenv_sandboxes", state="paused")) == (1, 1)


async def test_a_failing_source_is_left_out_of_that_scrape(
        caplog: pytest.LogCaptureFixture) -> None:
    m = Metrics()
    broken = True

    async def read() -> dict[str, int]:
        if broken:
            raise OSError("store is gone")
        return {"running": 1}

    m.track_sandboxes(read)
    page = await render(m)  # the rest of the page is still served
    assert "aenv_sandboxes" not in page.names()
    assert page.value("aenv_sandbox_operation_seconds_count", operation="create") == 0
    assert "store is gone" in caplog.text
    broken = False
    assert (await render(m)).value("aenv_sandboxes", state="running") == 1


async def test_a_source_registered_twice_is_refused() -> None:
    m = Metrics()

    async def read() -> dict[str, int]:
        return {}

    m.track_sandboxes(read)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        m.track_sandboxes(read)


def test_pss_of_this_process() -> None:
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("no /proc/<pid>/smaps_rollup (Linux 4.14+)")
    pss = pss_bytes(os.getpid())
    assert pss is not None
    assert 1 << 20 < pss < 1 << 34  # a Python process: MiBs, not nothing, not everything


def test_pss_of_a_process_that_is_gone() -> None:
    assert pss_bytes(2**22 + 12345) is None  # beyond pid_max's default


async def test_vm_memory_sums_the_pids_it_can_read() -> None:
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("no /proc/<pid>/smaps_rollup (Linux 4.14+)")
    m = Metrics()
    pids = [os.getpid()]
    m.track_vms(lambda: pids)
    one = (await render(m)).value("aenv_vm_memory_pss_bytes")
    pids = [os.getpid(), os.getpid(), 2**22 + 12345]  # a gone VM is skipped
    two = (await render(m)).value("aenv_vm_memory_pss_bytes")
    assert one > 1 << 20
    assert 1.5 * one < two < 2.5 * one
    pids = []
    assert (await render(m)).value("aenv_vm_memory_pss_bytes") == 0


async def test_storage_usage_by_cache_and_transfers_summed_by_backend() -> None:
    m = Metrics()

    async def usage() -> StorageUsage:
        return StorageUsage(
            caches=[CacheUsage(name="chunks", used_bytes=10, capacity_bytes=100, hits=7,
                               misses=3),
                    CacheUsage(name="memory", used_bytes=0, capacity_bytes=50, hits=0,
                               misses=1)],
            transfers=[Transfer(backend="oss", upload_bytes=5, download_bytes=1),  # host
                       Transfer(backend="oss", upload_bytes=2, download_bytes=9)])  # blockd

    m.track_storage(usage)
    page = await render(m)
    assert page.types["aenv_cache_hits"] == "counter"
    assert page.value("aenv_cache_used_bytes", cache="chunks") == 10
    assert page.value("aenv_cache_capacity_bytes", cache="chunks") == 100
    assert page.value("aenv_cache_hits_total", cache="chunks") == 7
    assert page.value("aenv_cache_misses_total", cache="chunks") == 3
    assert page.value("aenv_cache_misses_total", cache="memory") == 1
    assert page.value("aenv_repository_bytes_total", direction="upload", backend="oss") == 7
    assert page.value("aenv_repository_bytes_total", direction="download", backend="oss") == 10
