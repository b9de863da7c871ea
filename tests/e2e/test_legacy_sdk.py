"""An older Python SDK (e2b 2.50.0, the last before /v2 create + connect) in its own venv,
cached in ${AENV_CACHE:-/var/cache/aenv}/venv-e2b-2.50: create via `POST /sandboxes`,
commands.run, pause, legacy `POST /sandboxes/{id}/connect` (resume), kill."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]

VERSION = "2.50.0"

SCRIPT = textwrap.dedent("""
    import json, sys
    import e2b
    from e2b import Sandbox
    out = {"version": e2b.__version__ if hasattr(e2b, "__version__") else None}
    sbx = Sandbox.create(timeout=300, metadata={"legacy": "1"}, envs={"L": "old"})
    out["id"] = sbx.sandbox_id
    out["run"] = sbx.commands.run("echo $L; echo hi").stdout
    sbx.files.write("/home/user/legacy.txt", "v250")
    out["paused"] = sbx.pause() if hasattr(sbx, "pause") else Sandbox.beta_pause(sbx.sandbox_id)
    again = Sandbox.connect(sbx.sandbox_id, timeout=300)
    out["after_resume"] = again.files.read("/home/user/legacy.txt")
    out["connect_running"] = Sandbox.connect(sbx.sandbox_id).commands.run("echo ok").stdout
    out["killed"] = again.kill()
    out["kill_again"] = Sandbox.kill(sbx.sandbox_id)
    print(json.dumps(out))
""")


def legacy_python() -> Path:
    cache = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv")) / "venv-e2b-2.50"
    py = cache / "bin" / "python"
    if py.exists():
        return py
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=120)
        r = subprocess.run([str(tmp / "bin" / "pip"), "install", "-q", f"e2b=={VERSION}"],
                           capture_output=True, text=True, timeout=600, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot install e2b=={VERSION}: {r.stderr[-1000:]}")
        tmp.rename(cache)  # atomic: a half-built venv is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return py


def test_sdk_2_50_legacy_endpoints(service: E2EService) -> None:
    py = legacy_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(service.sdk_env())
    mark = service.log(10**9).count("\n")
    r = subprocess.run([str(py), "-c", SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600, check=False, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    sid = out["id"]
    assert out["run"] == "old\nhi\n"
    assert out["paused"] is True or out["paused"] is None
    assert out["after_resume"] == "v250"
    assert out["connect_running"] == "ok\n"
    assert out["killed"] is True and out["kill_again"] is False
    # it really went through the legacy endpoints (uvicorn access log of the service)
    log = "\n".join(service.log(10**9).splitlines()[mark:])
    assert '"POST /sandboxes HTTP/1.1" 201' in log, log[-3000:]
    assert f'"POST /sandboxes/{sid}/connect HTTP/1.1" 201' in log, log[-3000:]
    assert f'"POST /sandboxes/{sid}/connect HTTP/1.1" 200' in log, log[-3000:]
    assert "POST /v2/sandboxes HTTP" not in log
