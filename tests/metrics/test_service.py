"""`/metrics` of a whole node service, without VMs: the real REST API and proxy (wrapped in
`ProxyMetrics`, as `python -m host` serves it) over a real `NodeOrchestrator` and SQLite
store, whose runtime is the fake (tests/orchestrator/fakes.py) with its guests' envd port
forwarded to a real local HTTP server, so proxied requests go over TCP. Scraped with
httpx before and after each step of create -> proxied request -> pause -> resume -> kill
(plus snapshot, fork and refused operations), with exact deltas, every page parsed by the
Prometheus text parser."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from host.api import ApiKeys, build_api_app
from host.contract import NetworkConfig, Placement, SnapshotRef
from host.metrics import OPERATIONS, Metrics, ProxyMetrics
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.proxy import build_proxy_app
from tests.api.conftest import ServerThread
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

from .scrape import Scrape, scrape

KEY = "e2b_metrics_test"
DOMAIN = "sbx.test"
ENVD_PORT = 49983
GUEST_BODY = b"hello from the guest\n"


async def guest(scope: Scope, receive: Receive, send: Send) -> None:
    """What the proxy reaches "inside" the sandbox: a fixed answer to any request."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(GUEST_BODY)).encode())]})
    await send({"type": "http.response.body", "body": GUEST_BODY})


@pytest.fixture(scope="module")
def guest_port() -> Iterator[int]:
    with ServerThread(guest) as srv:
        yield srv.port


class ForwardingRuntime(FakeRuntime):
    """The fake runtime, its VMs' envd port forwarded to `guest_port` on loopback (None:
    not forwarded; the fake envd tells guests apart by address, so tests that start
    several sandboxes at once turn it off)."""

    def __init__(self, guest_port: int) -> None:
        super().__init__()
        self.guest_port: int | None = guest_port

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, **kwargs: Any) -> Placement:
        p = await super().start(sandbox_id, snapshot, network, reboot=reboot, **kwargs)
        if self.guest_port is None:
            return p
        p = Placement(sandbox_id, "127.0.0.1", p.envd_port,
                      {**p.facts, "port_forwards": {str(ENVD_PORT): self.guest_port}})
        self.vms[sandbox_id] = p
        return p


@dataclass
class Node:
    api: httpx.AsyncClient
    proxy: httpx.AsyncClient
    orchestrator: NodeOrchestrator
    runtime: ForwardingRuntime

    async def scrape(self) -> Scrape:
        return await scrape(self.api)

    async def proxied(self, sandbox_id: str, path: str = "/health") -> httpx.Response:
        return await self.proxy.get(path, headers={"e2b-sandbox-id": sandbox_id,
                                                   "e2b-sandbox-port": str(ENVD_PORT)})


@pytest.fixture
async def node(tmp_path: Path, guest_port: int) -> AsyncIterator[Node]:
    metrics = Metrics()
    runtime = ForwardingRuntime(guest_port)
    runtime.envd = envd = FakeEnvd()
    store = Store(tmp_path / "state.db")
    orch = NodeOrchestrator(store, runtime, domain=DOMAIN, metrics=metrics,
                            envd=EnvdClient(transport=envd.transport()))
    await orch.start(ttl_interval_s=3600)
    api_app = build_api_app(orch, ApiKeys([KEY]), domain=DOMAIN, metrics=metrics)
    proxy_app = build_proxy_app(orch, DOMAIN)
    try:
        async with (httpx.AsyncClient(transport=httpx.ASGITransport(app=api_app),
                                      base_url="http://api.sbx.test",
                                      headers={"X-API-Key": KEY}) as api,
                    httpx.AsyncClient(transport=httpx.ASGITransport(
                        app=ProxyMetrics(proxy_app, metrics)),
                        base_url="http://127.0.0.1:3001") as proxy):
            yield Node(api, proxy, orch, runtime)
    finally:
        await proxy_app.aclose()
        await orch.aclose(grace_s=5)
        store.close()


def states(page: Scrape) -> dict[str, float]:
    """The non-zero values of aenv_sandboxes by state."""
    return {dict(labels)["state"]: v for (name, labels), v in page.samples.items()
            if name == "aenv_sandboxes" and v}


def op_counts(after: Scrape, before: Scrape) -> dict[str, float]:
    """How many operations of each kind completed between the two scrapes (non-zero)."""
    moved = {op: after.delta(before, "aenv_sandbox_operation_seconds_count", operation=op)
             for op in OPERATIONS}
    return {op: n for op, n in moved.items() if n}


def check_histogram(page: Scrape, op: str) -> None:
    """The +Inf bucket is the count; buckets never decrease; the sum is positive."""
    count = page.value("aenv_sandbox_operation_seconds_count", operation=op)
    assert page.value("aenv_sandbox_operation_seconds_bucket", operation=op, le="+Inf") == count
    buckets = sorted(((float(dict(lbls)["le"]), v) for (n, lbls), v in page.samples.items()
                      if n == "aenv_sandbox_operation_seconds_bucket"
                      and dict(lbls)["operation"] == op))
    values = [v for _, v in buckets]
    assert values == sorted(values)
    assert (page.value("aenv_sandbox_operation_seconds_sum", operation=op) > 0) == (count > 0)


async def test_create_pause_resume_kill_move_the_metrics(node: Node) -> None:
    s0 = await node.scrape()
    assert s0.types["aenv_sandboxes"] == "gauge"
    assert s0.types["aenv_sandbox_operation_seconds"] == "histogram"
    assert states(s0) == {}
    assert s0.value("aenv_sandboxes", state="running") == 0
    assert all(s0.value("aenv_sandbox_operation_seconds_count", operation=op) == 0
               for op in OPERATIONS)
    assert s0.total("aenv_proxy_requests_total") == 0

    # create
    r = await node.api.post("/sandboxes", json={"templateID": "base", "timeout": 300})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    s1 = await node.scrape()
    assert op_counts(s1, s0) == {"create": 1}
    assert states(s1) == {"running": 1}
    assert s1.total("aenv_sandbox_operation_errors_total") == 0
    check_histogram(s1, "create")

    # a request through the proxy, over TCP to the "guest"
    r = await node.proxied(sid)
    assert (r.status_code, r.content) == (200, GUEST_BODY)
    s2 = await node.scrape()
    assert s2.delta(s1, "aenv_proxy_requests_total", kind="http", status="2xx") == 1
    assert s2.delta(s1, "aenv_proxy_requests_total") == 1
    assert s2.delta(s1, "aenv_proxy_bytes_total", direction="out") == len(GUEST_BODY)
    assert s2.delta(s1, "aenv_proxy_bytes_total", direction="in") == 0
    assert op_counts(s2, s1) == {}

    # pause
    assert (await node.api.post(f"/sandboxes/{sid}/pause")).status_code == 204
    s3 = await node.scrape()
    assert op_counts(s3, s2) == {"pause": 1}
    assert states(s3) == {"paused": 1}
    check_histogram(s3, "pause")

    # a second pause is refused (409): an error of the pause, no duration
    assert (await node.api.post(f"/sandboxes/{sid}/pause")).status_code == 409
    s4 = await node.scrape()
    assert op_counts(s4, s3) == {}
    assert s4.value("aenv_sandbox_operation_errors_total", operation="pause",
                    error="StateConflict") == 1
    assert s4.delta(s3, "aenv_sandbox_operation_errors_total") == 1
    assert states(s4) == {"paused": 1}

    # resume
    r = await node.api.post(f"/sandboxes/{sid}/connect", json={"timeout": 300})
    assert r.status_code == 201, r.text
    s5 = await node.scrape()
    assert op_counts(s5, s4) == {"resume": 1}
    assert states(s5) == {"running": 1}
    check_histogram(s5, "resume")

    # connecting to a running sandbox only extends its TTL: no resume
    assert (await node.api.post(f"/sandboxes/{sid}/connect",
                                json={"timeout": 300})).status_code == 200
    assert op_counts(await node.scrape(), s5) == {}

    # kill
    assert (await node.api.delete(f"/sandboxes/{sid}")).status_code == 204
    s6 = await node.scrape()
    assert op_counts(s6, s5) == {"kill": 1}
    assert states(s6) == {}
    assert s6.value("aenv_sandboxes", state="running") == 0  # still listed, at 0
    check_histogram(s6, "kill")

    # the proxy refuses a killed sandbox (502): counted as such
    assert (await node.proxied(sid)).status_code == 502
    s7 = await node.scrape()
    assert s7.delta(s6, "aenv_proxy_requests_total", kind="http", status="5xx") == 1
    assert s7.delta(s6, "aenv_proxy_bytes_total", direction="out") > 0  # the JSON answer

    # over the whole cycle: one of each, and the one refused pause
    assert op_counts(s7, s0) == {"create": 1, "pause": 1, "resume": 1, "kill": 1}
    assert s7.delta(s0, "aenv_sandbox_operation_errors_total") == 1


async def test_proxy_auto_resume_is_a_resume(node: Node) -> None:
    r = await node.api.post("/sandboxes", json={"templateID": "base",
                                                "autoResume": {"enabled": True}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert (await node.api.post(f"/sandboxes/{sid}/pause")).status_code == 204
    before = await node.scrape()
    assert (await node.proxied(sid)).status_code == 200  # resumes it on the way
    after = await node.scrape()
    assert op_counts(after, before) == {"resume": 1}
    assert states(after) == {"running": 1}


async def test_snapshot_and_fork_are_timed(node: Node) -> None:
    node.runtime.guest_port = None  # three sandboxes at once
    r = await node.api.post("/sandboxes", json={"templateID": "base"})
    sid = r.json()["sandboxID"]
    s0 = await node.scrape()
    r = await node.api.post(f"/sandboxes/{sid}/snapshots", json={"name": "metrics-snap"})
    assert r.status_code == 201, r.text
    r = await node.api.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code in (200, 201), r.text
    assert all(child.get("error") is None for child in r.json()), r.text
    s1 = await node.scrape()
    assert op_counts(s1, s0) == {"snapshot": 1, "fork": 1}  # fork children: not creates
    assert states(s1) == {"running": 3}
    check_histogram(s1, "snapshot")
    check_histogram(s1, "fork")


async def test_failed_operations_count_by_error_class(node: Node) -> None:
    r = await node.api.post("/sandboxes", json={"templateID": "base"})
    sid = r.json()["sandboxID"]
    s0 = await node.scrape()
    node.runtime.fail["snapshot"] = lambda _sid: True  # the VMM fails: rolled back, 500
    assert (await node.api.post(f"/sandboxes/{sid}/pause")).status_code == 500
    node.runtime.fail["start"] = lambda _sid: True
    assert (await node.api.post("/sandboxes", json={"templateID": "base"})).status_code == 500
    assert (await node.api.delete("/sandboxes/i" + "0" * 20)).status_code == 404
    s1 = await node.scrape()
    assert op_counts(s1, s0) == {}
    assert s1.delta(s0, "aenv_sandbox_operation_errors_total", operation="pause",
                    error="OperationFailed") == 1
    assert s1.delta(s0, "aenv_sandbox_operation_errors_total", operation="create",
                    error="OperationFailed") == 1
    assert s1.delta(s0, "aenv_sandbox_operation_errors_total", operation="kill",
                    error="SandboxNotFound") == 1
    assert s1.delta(s0, "aenv_sandbox_operation_errors_total") == 3
    assert states(s1) == {"running": 1}  # the failed create is killed, the pause rolled back


async def test_fork_children_that_fail_count_as_fork_errors(node: Node) -> None:
    node.runtime.guest_port = None
    r = await node.api.post("/sandboxes", json={"templateID": "base"})
    parent = r.json()["sandboxID"]
    s0 = await node.scrape()
    node.runtime.fail["start"] = lambda sid: sid != parent  # every child's VM fails
    r = await node.api.post(f"/sandboxes/{parent}/fork", json={"count": 2})
    assert r.status_code in (200, 201), r.text
    s1 = await node.scrape()
    assert op_counts(s1, s0) == {"fork": 1}  # the fork itself went through
    assert s1.delta(s0, "aenv_sandbox_operation_errors_total", operation="fork",
                    error="OperationFailed") == 2
    assert states(s1) == {"running": 1}
