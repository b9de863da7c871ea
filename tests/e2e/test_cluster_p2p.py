"""`--p2p` with real VMs: two `python -m host` nodes (own network namespaces, LocalCluster)
on one `oss` repository (a real moto S3 server process the namespaces reach over their
veth pairs). A template built through the gateway on one node starts a sandbox on the
other, whose memory files and layer bytes come from the first node before the repository
(host/cluster/peers.py, host/storage/peers.py); the sandbox sees the template's files.

Times are printed (the note quotes them), never asserted.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3  # type: ignore[import-untyped]
import pytest

from host.cluster.local import LocalCluster
from tests.conftest import moto_server
from tests.orchestrator.hostproc import free_port

from .conftest import need_vm

pytestmark = [pytest.mark.vm, pytest.mark.slow]


@pytest.fixture(scope="module")
def p2p_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    need_vm()
    mp = pytest.MonkeyPatch()
    mp.setenv("AWS_ACCESS_KEY_ID", "testing")
    mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    bucket = f"p2p{uuid.uuid4().hex[:8]}"
    try:
        with moto_server(tmp_path_factory.mktemp("moto"), bind="0.0.0.0") as endpoint:
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket=bucket)
            port = endpoint.rsplit(":", 1)[1]
            c = LocalCluster(
                nodes=2, root=Path("/var/tmp") / f"aenv-p2p-{uuid.uuid4().hex[:8]}",
                prefix="ap2p", subnet="10.249", pool_base=200,
                gateway_port=free_port(), scheduler_port=free_port(), redis_port=free_port(),
                repository=(f"oss://{bucket}/aenv?endpoint=http://{{host}}:{port}"
                            "&region=us-east-1&addressing_style=path"),
                node_args=["--memory-mb", "256", "--envd-timeout", "240", "--warm-pool", "0",
                           "--p2p"])
            c.start()
            try:
                yield c
            finally:
                c.stop()
                assert c.root is not None
                shutil.rmtree(c.root, ignore_errors=True)
    finally:
        mp.undo()
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True, check=True).stdout.split("\n")
                if ns.startswith("ap2p")], "the cluster left network namespaces"


def test_a_template_from_one_node_starts_on_the_other_from_its_neighbour(
        p2p_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox, Template

    c = p2p_cluster
    for k, v in (("E2B_API_URL", c.gateway_url), ("E2B_SANDBOX_URL", c.gateway_url),
                 ("E2B_API_KEY", c.api_key), ("E2B_DOMAIN", "sbx.localhost")):
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    Template.build(Template().from_template("base").run_cmd("echo from-node > /home/user/p2p"),
                   "p2p-tpl", on_build_logs=lambda e: None)
    print(f"\np2p: base + template built on one node (oss) {time.monotonic() - t0:.1f} s")
    boxes = []
    try:
        t0 = time.monotonic()
        boxes = [Sandbox.create(template="p2p-tpl", timeout=600) for _ in range(2)]
        print(f"p2p: 2 creates from it (round-robin: one per node) "
              f"{time.monotonic() - t0:.1f} s")
        for b in boxes:
            assert b.commands.run("cat /home/user/p2p").stdout.strip() == "from-node"
    finally:
        for b in boxes:
            b.kill()
    logs = {i: c.log(f"node{i}", 400_000) for i in (1, 2)}
    memory = {i: len(re.findall(r"fetched \S+ from a neighbour", logs[i])) for i in logs}
    repo = {i: len(re.findall(r"fetched \S+ from the repository", logs[i])) for i in logs}
    print(f"p2p: memory files from a neighbour {memory}, from the repository {repo}")
    said = {i: [line for line in logs[i].splitlines()
                if re.search(r"neighbour|fetched|announc|memory files", line)] for i in logs}
    assert min(memory.values()) == 0 and max(memory.values()) >= 1, said
    other = max(memory, key=lambda i: memory[i])
    assert c.root is not None
    blockd = (c.root / f"node{other}" / "blockserver.log").read_text(errors="replace")
    assert "reading chunks from neighbour" in blockd, blockd[-3000:]
