"""`/metrics` of a real `python -m host` while a real VM goes through create -> command ->
pause -> resume -> kill: the page parses with the Prometheus text parser at every step,
and the gauges, counters and histograms move exactly as the operations say. Deltas, not
absolute values: the session's service has served other tests already."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from tests.metrics.scrape import Scrape, scrape_sync

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]

OPS = "aenv_sandbox_operation_seconds_count"


def _ops(after: Scrape, before: Scrape) -> dict[str, float]:
    return {op: after.delta(before, OPS, operation=op)
            for op in ("create", "pause", "resume", "fork", "snapshot", "kill")}


def test_metrics_follow_a_sandbox_through_its_life(env: E2EService) -> None:
    start = scrape_sync(env.api_url)
    assert start.types["aenv_sandbox_operation_seconds"] == "histogram"
    assert start.types["aenv_proxy_requests"] == "counter"

    sbx = Sandbox.create(timeout=300)
    created = scrape_sync(env.api_url)
    assert _ops(created, start) == {"create": 1, "pause": 0, "resume": 0, "fork": 0,
                                    "snapshot": 0, "kill": 0}
    assert created.delta(start, "aenv_sandboxes", state="running") == 1
    assert created.value("aenv_vm_memory_pss_bytes") > 32 << 20  # a 256 MiB guest's QEMU

    assert sbx.commands.run("echo through-the-proxy").stdout.strip() == "through-the-proxy"
    ran = scrape_sync(env.api_url)
    assert ran.delta(created, "aenv_proxy_requests_total", kind="http", status="2xx") >= 1
    assert ran.delta(created, "aenv_proxy_bytes_total", direction="out") > 0

    assert sbx.pause() is True
    answered = scrape_sync(env.api_url)  # answered once stopped: written behind the answer
    assert (answered.delta(ran, "aenv_sandboxes", state="pausing")
            + answered.delta(ran, "aenv_sandboxes", state="paused")) == 1
    paused = answered
    for _ in range(600):  # the pause is committed (and the VM gone) within seconds
        if paused.delta(ran, "aenv_sandboxes", state="paused") == 1:
            break
        time.sleep(0.05)
        paused = scrape_sync(env.api_url)
    assert _ops(paused, ran)["pause"] == 1
    assert paused.delta(ran, "aenv_sandboxes", state="running") == -1
    assert paused.delta(ran, "aenv_sandboxes", state="paused") == 1
    assert paused.value("aenv_vm_memory_pss_bytes") < ran.value("aenv_vm_memory_pss_bytes")

    Sandbox.connect(sbx.sandbox_id, timeout=300)
    resumed = scrape_sync(env.api_url)
    assert _ops(resumed, paused) == {"create": 0, "pause": 0, "resume": 1, "fork": 0,
                                     "snapshot": 0, "kill": 0}
    assert resumed.delta(paused, "aenv_sandboxes", state="paused") == -1
    # a pause that cannot happen (already paused -> 409) is an error of the operation
    assert Sandbox.pause(sbx.sandbox_id) is True  # pause again, for the refused one below
    assert Sandbox.pause(sbx.sandbox_id) is False
    refused = scrape_sync(env.api_url)
    assert refused.delta(resumed, "aenv_sandbox_operation_errors_total", operation="pause",
                         error="StateConflict") == 1

    Sandbox.kill(sbx.sandbox_id)
    killed = scrape_sync(env.api_url)
    assert _ops(killed, refused)["kill"] == 1
    assert killed.delta(refused, "aenv_sandboxes", state="paused") == -1
    # the histogram's buckets are cumulative and end at the count
    for op in ("create", "pause", "resume", "kill"):
        assert killed.value("aenv_sandbox_operation_seconds_bucket", operation=op,
                            le="+Inf") == killed.value(OPS, operation=op)
        assert killed.value("aenv_sandbox_operation_seconds_sum", operation=op) > 0
