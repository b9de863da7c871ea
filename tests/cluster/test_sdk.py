"""The real Python e2b SDK, unmodified, pointed only at the gateway (E2B_API_URL and
E2B_SANDBOX_URL both the gateway): create, list (paginated), info, commands and files
through the gateway and a node's proxy into envd, pause and resume, kill, and how a
sandbox lost with its node surfaces."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests.api.conftest import API_KEY

from .harness import DOMAIN, Cluster
from .test_failover import DEAD_BOUND_S, wait_for
from .test_gateway import api, where


@pytest.fixture
def sdk(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("E2B_API_URL", cluster.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", cluster.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", DOMAIN)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return cluster


def test_sdk_create_list_use_kill(sdk: Cluster) -> None:
    boxes = [Sandbox.create(metadata={"suite": "cluster"}) for _ in range(4)]
    try:
        paginator = Sandbox.list(limit=3)
        listed = []
        while paginator.has_next:
            listed += [s.sandbox_id for s in paginator.next_items()]
        assert sorted(listed) == sorted(b.sandbox_id for b in boxes)
        sbx = boxes[0]
        assert sbx.get_info().metadata == {"suite": "cluster"}
        result = sbx.commands.run("echo hello from $((6 * 7))")
        assert result.exit_code == 0 and result.stdout.strip() == "hello from 42"
        path = f"/tmp/aenv-cluster-{uuid.uuid4().hex}.txt"
        try:
            sbx.files.write(path, "through the gateway")
            assert sbx.files.read(path) == "through the gateway"
        finally:
            Path(path).unlink(missing_ok=True)
        assert sbx.is_running()
        sbx.pause()
        assert sbx.get_info().state.value == "paused"
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.get_info().state.value == "running"
    finally:
        for b in boxes:
            assert b.kill() is True
    assert Sandbox.list().next_items() == []
    assert Sandbox.kill(boxes[0].sandbox_id) is False


def test_sdk_sees_a_lost_sandbox(sdk: Cluster) -> None:
    sbx = Sandbox.create()
    with api(sdk) as c:
        holder = sdk.node(where(sdk, c)[sbx.sandbox_id])
    holder.stop()
    time.sleep(DEAD_BOUND_S)
    wait_for("lost", lambda: not sbx.is_running(), 5)
    with pytest.raises(SandboxException, match="410: .*was lost"):
        sbx.get_info()
    assert sbx.kill() is False



def test_signed_file_urls_without_headers(sdk: Cluster) -> None:
    """E2B_SANDBOX_URL mode's `upload_url` / `download_url` name no sandbox: the gateway
    asks the nodes which sandbox's token made the signature (POST /cluster/signer) and
    relays to its node's proxy; a client sends nothing but the URL."""
    boxes = [Sandbox.create() for _ in range(3)]   # one per node: any could be meant
    path = f"/tmp/aenv-cluster-signed-{uuid.uuid4().hex}.txt"
    try:
        with api(sdk) as c:
            assert len(set(where(sdk, c).values())) == 3
        sbx = boxes[1]
        up = sbx.upload_url(path, use_signature_expiration=120)
        down = sbx.download_url(path, use_signature_expiration=120)
        assert up.startswith(sdk.url) and sbx.sandbox_id not in up
        r = httpx.post(up, files={"file": ("f.txt", b"signed through the gateway")})
        assert r.status_code == 200, r.text
        r = httpx.get(down)
        assert r.status_code == 200 and r.text == "signed through the gateway"
        r = httpx.get(down.replace("signature=v1_", "signature=v1_x"))
        assert r.status_code == 400 and "E2b-Sandbox-Id" in r.json()["message"]
    finally:
        Path(path).unlink(missing_ok=True)
        for b in boxes:
            b.kill()
