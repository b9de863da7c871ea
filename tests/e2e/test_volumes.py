"""E2B volumes in real VMs (QEMU under TCG), driven by the e2b Python SDK: a volume
written from the host API, mounted in two sandboxes at once, each seeing the other's
writes; the mount and its data through pause + resume and in a fork child; ownership by
the guest user; destroy while mounted; a service restart keeps the volume and serves the
mount again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from .conftest import E2EService, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]

MNT = "/mnt/data"
JS = Path(__file__).resolve().parents[1] / "js"


def run(sbx, cmd: str, user: str = "user") -> str:
    r = sbx.commands.run(cmd, user=user, timeout=120)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def fails(sbx, cmd: str, user: str = "user") -> str:
    """The stderr of `cmd`, which must fail."""
    from e2b.sandbox.commands.command_handle import CommandExitException

    with pytest.raises(CommandExitException) as e:
        sbx.commands.run(cmd, user=user, timeout=120)
    return e.value.stderr


def test_volume_shared_by_two_sandboxes_through_pause_fork_and_restart(
        service: E2EService, monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox, Volume

    use_sdk(service, monkeypatch)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    vol = Volume.create(name)
    vol.write_file("/seed.txt", "from the host API\n")
    a = Sandbox.create(timeout=600, volume_mounts={MNT: vol})
    b = Sandbox.create(timeout=600, volume_mounts={"/data": name})
    made = [a, b]
    try:
        assert a.get_info().volume_mounts == [{"name": name, "path": MNT}]
        # the host API's file, read in the guest; E2B's default owner and mode
        assert run(a, f"cat {MNT}/seed.txt") == "from the host API\n"
        assert run(a, f"stat -c '%u %g %a' {MNT}/seed.txt").split() == ["9090", "9090", "666"]
        # a guest user's file is theirs; the other sandbox and the API see it at once
        run(a, f"mkdir -p {MNT}/a && echo hello-from-a > {MNT}/a/note")
        assert run(b, "cat /data/a/note") == "hello-from-a\n"
        entry = vol.get_info("/a/note")
        assert (entry.uid, entry.size) == (1000, len("hello-from-a\n"))
        run(b, "dd if=/dev/urandom of=/data/blob bs=1M count=8 status=none")
        assert run(a, f"sha256sum < {MNT}/blob") == run(b, "sha256sum < /data/blob")
        assert len(vol.read_file("/blob", format="bytes")) == 8 << 20
        # permissions are the guest kernel's, against what the host reports
        run(a, f"sudo install -m 600 -o root /dev/null {MNT}/rootonly", user="root")
        assert "Permission denied" in fails(a, f"cat {MNT}/rootonly")

        # pause + resume: the same mount, its data, and new writes
        a.pause()
        a.connect()
        assert run(a, f"cat {MNT}/a/note") == "hello-from-a\n"
        run(a, f"echo after-resume >> {MNT}/a/note")
        assert run(b, "tail -1 /data/a/note") == "after-resume\n"

        # a fork child has the volume mounted too
        (child,) = a.fork(count=1, timeout=300)
        assert not isinstance(child, Exception), child
        made.append(child)
        run(child, f"echo from-child > {MNT}/child")
        assert run(b, "cat /data/child") == "from-child\n"

        # a restart of the service: the volume is kept, the mounts are served again
        service.stop()
        service.start()
        assert [v.name for v in Volume.list() if v.name == name] == [name]
        a = Sandbox.connect(a.sandbox_id)
        assert run(a, f"cat {MNT}/child") == "from-child\n"

        # destroying a mounted volume is allowed (as E2B); its mounts then fail
        assert Volume.destroy(vol.volume_id)
        fails(a, f"ls {MNT}")
    finally:
        for s in made:
            with contextlib.suppress(Exception):   # best effort: the service cleans up
                s.kill()


@pytest.mark.js
def test_js_sdk_volume_flow(service: E2EService) -> None:
    if shutil.which("node") is None or not (JS / "node_modules" / "e2b").exists():
        pytest.fail("node or tests/js/node_modules/e2b missing (make setup runs npm ci)")
    name = f"e2e-js-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(service.sdk_env())
    env["E2B_DOMAIN"] = "sbx.localhost"
    r = subprocess.run(["node", str(JS / "volumes.mjs"), name], env=env, cwd=JS,
                       capture_output=True, text=True, timeout=900, check=False)
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert r.returncode == 0 and "error" not in out, (out, r.stderr[-2000:])
    assert out["created"] == {"name": name, "hasToken": True}
    assert out["info"] == [{"name": name, "path": "/mnt/js"}]
    assert out["readInA"] == "written by the js SDK\n"
    assert out["readInB"] == "from-a\n" and out["readByApi"] == "from-a\n"
    assert out["listed"] == ["/a.txt:file", "/from-js.txt:file"]
    assert out["afterResume"] == "from-a\nafter-resume\n"
    assert out["listedVolumes"] == 1
    assert (out["destroyed"], out["destroyedAgain"]) == (True, False)
    assert "invalid mounts" in out["unknown"] and "no-such-volume" in out["unknown"]
