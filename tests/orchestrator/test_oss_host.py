"""A paused sandbox resumes on a fresh host process with an empty local cache, from an
`oss` repository (a real moto S3 server process): `python -m host --repository oss://...`
creates a sandbox (building the template into the repository), the SDK writes a file and
starts a process, pauses; the service and its block server are stopped and every local
file of the node is deleted except the SQLite state and the API keys; a new service
process on that state resumes the sandbox through the SDK with both intact.

Own namespace prefix `aoh-` and pool 10.218.32.0/20."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from .hostproc import HostService
from .test_node_vm import _need_vm

pytestmark = [pytest.mark.vm, pytest.mark.slow]

KEEP = {"state.db", "state.db-wal", "state.db-shm", "api_keys"}


@pytest.fixture
def oss_svc(moto_endpoint: str, s3_env: dict[str, str],
            monkeypatch: pytest.MonkeyPatch) -> Iterator[HostService]:
    _need_vm()
    bucket = f"h{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    repo = f"oss://{bucket}/node?endpoint={moto_endpoint}&region=us-east-1"
    root = Path(tempfile.mkdtemp(prefix="aenv-orch-oss-", dir="/var/tmp"))
    s = HostService(root, prefix="aoh-", pool="10.218.32.0/20", tag="aoh",
                    extra=["--repository", repo])
    try:
        s.start()
        monkeypatch.setenv("E2B_API_URL", s.api_url)
        monkeypatch.setenv("E2B_SANDBOX_URL", s.sandbox_url)
        monkeypatch.setenv("E2B_API_KEY", s.api_key)
        monkeypatch.delenv("E2B_DOMAIN", raising=False)
        yield s
    finally:
        s.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def _wipe_local_state(s: HostService) -> list[str]:
    """Stop everything of the node (service, block server) and delete its local files but
    the SQLite state and the API keys; returns what was deleted."""
    s.stop()
    for pid in s.our_processes():  # the block server outlives the service by design
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gone = []
    for p in s.state.iterdir():
        if p.name not in KEEP:
            gone.append(p.name)
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(s.run, ignore_errors=True)
    return sorted(gone)


def test_resume_on_a_fresh_host_process_from_oss(oss_svc: HostService) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=600)
    sid = sbx.sandbox_id
    sbx.files.write("/home/user/data.txt", "kept in the repository")
    pid = sbx.commands.run("sleep 100000", background=True).pid
    assert sbx.pause()
    # answered once the guest stopped; written behind it: a stop waits for the commit
    assert oss_svc.db_states()[sid] in ("pausing", "paused")

    deleted = _wipe_local_state(oss_svc)
    assert oss_svc.db_states()[sid] == "paused"
    assert {"memory", "storage", "cache"} <= set(deleted), deleted
    assert not (oss_svc.state / "repo").exists()  # nothing went to a local repository
    assert {p.name for p in oss_svc.state.iterdir()} <= KEEP

    oss_svc.start()
    again = Sandbox.connect(sid, timeout=120)  # resumes (POST /v2/sandboxes/{id}/connect)
    assert again.files.read("/home/user/data.txt") == "kept in the repository"
    assert again.commands.run(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    assert oss_svc.db_states()[sid] == "running"
    fetched = {p.name for p in (oss_svc.state / "memory").iterdir()}
    assert len(fetched) >= 2, fetched  # the template's base and the pause's diff
    again.kill()
