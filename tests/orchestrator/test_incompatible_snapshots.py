"""A snapshot whose memory the node's VMM cannot restore (issue 14 item 20) reaches the
client as a 409 naming both VMM versions and the reboot resume, not a 500: the REST API
over a real NodeOrchestrator whose fake runtime raises what `host.runtime.starts` raises
(its own `check_vmm`). The sandbox stays paused and a reboot resume (memory=false) works."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from host.contract import NetworkConfig, Placement, SnapshotRef
from host.runtime.starts import check_vmm
from host.vmm.identity import VmmIdentity
from tests.api.conftest import API_KEY
from tests.api.template_service import NodeService

pytestmark = pytest.mark.asyncio(loop_scope="function")

OLD = VmmIdentity(vmm="qemu", version="QEMU emulator version 7.2.19", accel="tcg", cpu="max")
NEW = VmmIdentity(vmm="qemu", version="QEMU emulator version 8.2.2", accel="tcg", cpu="max")


@pytest.fixture
async def svc(tmp_path: Path) -> AsyncIterator[NodeService]:
    s = NodeService(tmp_path)
    await s.start()
    runtime: Any = s.runtime
    real_start = runtime.start
    runtime.upgraded = False
    runtime.old = set()  # the snapshots saved before the upgrade

    async def start(sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, **kwargs: Any) -> Placement:
        if runtime.upgraded and not runtime.old:
            runtime.old = set(runtime.snapshots)
        if snapshot.snapshot_id in runtime.old and not reboot:  # saved by the old QEMU
            kind = "template" if snapshot.snapshot_id.startswith("tmpl-") else "snapshot"
            check_vmm(snapshot.snapshot_id, {"vmm": OLD.to_json(), "kind": kind}, NEW)
        return await real_start(sandbox_id, snapshot, network, reboot=reboot, **kwargs)

    runtime.start = start
    yield s
    await s.aclose()
    s.close_store()


@pytest.fixture
async def api(svc: NodeService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=svc.app),
                                 base_url="http://api.sbx.test",
                                 headers={"X-API-Key": API_KEY}) as c:
        yield c


async def test_resume_of_an_incompatible_pause_is_a_409_naming_both(
        svc: NodeService, api: httpx.AsyncClient) -> None:
    r = await api.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert (await api.post(f"/sandboxes/{sid}/pause")).status_code == 204
    svc.runtime.upgraded = True  # type: ignore[attr-defined]
    r = await api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60})
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["code"] == 409
    assert "QEMU emulator version 7.2.19" in body["message"]
    assert "QEMU emulator version 8.2.2" in body["message"]
    assert 'on_resume="reboot"' in body["message"]
    assert "Should-Retry" not in r.headers
    assert (await api.get(f"/sandboxes/{sid}")).json()["state"] == "paused"
    # the reboot resume the message suggests works
    r = await api.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 60, "memory": False})
    assert r.status_code == 201, r.text
    assert svc.runtime.reboots == [sid]


async def test_a_stale_default_template_is_rebuilt_and_a_stale_snapshot_is_a_409(
        svc: NodeService, api: httpx.AsyncClient) -> None:
    r = await api.post("/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201, r.text
    r = await api.post(f"/sandboxes/{r.json()['sandboxID']}/snapshots", json={})
    assert r.status_code == 201, r.text
    named = r.json()["snapshotID"]
    builds = svc.runtime.builds  # type: ignore[attr-defined]
    svc.runtime.upgraded = True  # type: ignore[attr-defined]
    # the default template is the node's own: rebuilt once for the new VMM, then used
    made = [await api.post("/sandboxes", json={"templateID": "base"}) for _ in range(2)]
    assert [m.status_code for m in made] == [201, 201], made[0].text
    assert svc.runtime.builds == builds + 1  # type: ignore[attr-defined]
    # a user's snapshot cannot be rebuilt: a 409 that says what to do
    r = await api.post("/sandboxes", json={"templateID": named})
    assert r.status_code == 409, r.text
    assert "8.2.2" in r.json()["message"] and "reboot" in r.json()["message"]
