"""Issue 14 parity items 3, 5, 6 and 8 in a real sandbox VM, through the unmodified SDKs
(Python 2.63.0 and, via tests/js/parity.mjs, JS 2.51.0), mode B env. The checks are the
ones tests/envd/test_parity_envd.py runs against envd on the host
(tests/envd/parity_checks.py names the E2B envd Go code behind each expectation); here
they go through the host proxy to the guest's envd, with TCG-sized waits.

One sandbox (`box`, module scope) serves the Python checks; the JS script makes its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.envd import parity_checks as checks

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]

JS = Path(__file__).resolve().parents[1] / "js"
WAIT_S = 60.0    # events / output under TCG
SETTLE_S = 2.0   # then nothing more may arrive


@pytest.fixture(scope="module")
def box(env: E2EService):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=900, metadata={"suite": "e2e-parity"})
    try:
        yield sbx
    finally:
        sbx.kill()


@pytest.fixture
def base(box) -> str:
    """A fresh directory of the default user in the guest."""
    path = f"/home/user/parity-{uuid.uuid4().hex[:8]}"
    box.commands.run(f"mkdir -p {path}")
    return path


@pytest.fixture
async def abox(box):
    from e2b import AsyncSandbox

    return await AsyncSandbox.connect(box.sandbox_id)


# ---- item 3 --------------------------------------------------------------------------------

def test_symlinks_report_their_target_like_e2b(box, base) -> None:
    checks.check_symlink_entries(box, base)


# ---- item 5 --------------------------------------------------------------------------------

@pytest.mark.parametrize("recursive", [False, True])
async def test_watch_events_like_e2b(abox, base, recursive) -> None:
    await checks.check_watch_events(abox, base, recursive=recursive, timeout_s=WAIT_S,
                                    settle_s=SETTLE_S)


def test_polling_watch_events_like_e2b(box, base) -> None:
    checks.check_polling_watch(box, base, timeout_s=WAIT_S)


# ---- item 6 --------------------------------------------------------------------------------

async def test_pty_output_reaches_a_reattached_handle(abox) -> None:
    await checks.check_pty_reattach(abox, timeout_s=WAIT_S)


def test_pty_output_reaches_a_reattached_handle_sync(box) -> None:
    checks.check_pty_reattach_sync(box, timeout_s=WAIT_S)


# ---- item 8 --------------------------------------------------------------------------------

def test_write_files_makes_parents_the_user_cannot_like_e2b(box, base) -> None:
    checks.check_write_files_parents(box, base, "/0")


def test_write_files_all_or_nothing(box, base) -> None:
    checks.check_write_files_all_or_nothing(box, base)
    leftovers = box.commands.run(f"find {base} -name '.envd-upload-*'").stdout
    assert leftovers == ""


# ---- JS SDK, all four items ------------------------------------------------------------------

@pytest.mark.js
def test_js_parity(env: E2EService) -> None:
    if shutil.which("node") is None or not (JS / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    environ.update(env.sdk_env())
    environ.update({"E2B_DOMAIN": "sbx.localhost", "PARITY_SLOW": "1"})
    r = subprocess.run(["node", "parity.mjs", "/home/user/parity-js", "/0"], cwd=JS,
                       env=environ, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    for name in ("symlinks", "watch flat", "watch recursive", "pty reattach", "write parents",
                 "write all-or-nothing"):
        assert f"ok {name}\n" in r.stdout
    assert r.stdout.endswith("all ok\n")
