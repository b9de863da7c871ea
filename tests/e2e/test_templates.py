"""Templates built through the E2B template API by the unmodified SDKs, on real VMs: from
an existing template (run_cmd, copy, set_envs, set_workdir, set_user, set_start_cmd with a
ready check) and from an OCI image pushed into a registry on loopback (a busybox-only
image); sandboxes from them see the files, env, workdir and user, and the start command's
server already answers through the proxy; a rebuild is all cache hits; bad input fails
with the SDK's BuildException and leaves nothing running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.images.conftest import PushedImages, Registry
from tests.orchestrator.hostproc import REPO

from .conftest import E2EService
from .test_python_sdk import _wait_port

pytestmark = [pytest.mark.vm, pytest.mark.slow]

JS = REPO / "tests" / "js"
PROCESSES = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"  # the guest has no ps


def _context(tmp: Path, text: str) -> Path:
    ctx = tmp / "ctx"
    (ctx / "site").mkdir(parents=True)
    (ctx / "site" / "index.html").write_text(text)
    return ctx


def test_python_sdk_builds_from_a_template_and_runs_it(sdk: E2EService, tmp_path: Path) -> None:
    from e2b import Sandbox, Template, wait_for_port

    ctx = _context(tmp_path, "hello from a built template\n")
    t = (Template(file_context_path=str(ctx)).from_template("base")
         .run_cmd("mkdir -p /app && chown user:user /app", user="root")
         .copy("site/index.html", "/app/")
         .set_envs({"GREETING": "hi there"})
         .set_workdir("/app")
         .set_user("user")
         .run_cmd("echo $GREETING > greeting.txt && echo step-output-line")
         # `exec -a` is a bash builtin: E2B runs a start command through `bash -l -c`
         .set_start_cmd("(exec -a py-start-marker sleep infinity) & python3 -m http.server 8000",
                        wait_for_port(8000)))
    logs: list[str] = []
    t0 = time.monotonic()
    info = Template.build(t, "e2e-site", on_build_logs=lambda e: logs.append(e.message))
    first_s = time.monotonic() - t0
    assert info.name == "e2e-site" and "step-output-line" in logs
    box = Sandbox.create(template="e2e-site")
    try:
        out = box.commands.run("pwd; cat greeting.txt; echo $GREETING; whoami").stdout
        assert out.split("\n")[:4] == ["/app", "hi there", "hi there", "user"]
        # the start command's renamed process lives on in the sandbox
        assert "py-start-marker" in box.commands.run(PROCESSES).stdout
        assert box.files.read("/app/index.html") == "hello from a built template\n"
        r = _wait_port(sdk, box.get_host(8000), "/index.html", timeout_s=5)
        assert r.status_code == 200 and r.text == "hello from a built template\n"
    finally:
        box.kill()
    logs.clear()
    t0 = time.monotonic()
    Template.build(t, "e2e-site", on_build_logs=lambda e: logs.append(e.message))
    cached_s = time.monotonic() - t0
    cached = [m for m in logs if m.startswith("CACHED")]
    assert len(cached) == 6, logs  # every step
    assert any(m.startswith("Reusing ready build") for m in logs), logs  # and no VM
    print(f"\ntemplate build {first_s:.1f}s, rebuild all cached {cached_s:.1f}s")


def test_python_sdk_builds_from_a_busybox_image(sdk: E2EService, registry: Registry,
                                                images: PushedImages) -> None:
    from e2b import Sandbox, Template

    t = (Template().from_image(f"{registry.host}/busybox:1")
         .run_cmd("echo from-python > /srv/py.txt")
         .set_start_cmd("httpd -f -p 8080 -h /srv", "pidof httpd"))  # no pgrep in busybox
    logs: list[str] = []
    Template.build(t, "e2e-busybox", on_build_logs=lambda e: logs.append(e.message))
    assert any("applying layer 1/1" in m for m in logs), logs
    box = Sandbox.create(template="e2e-busybox")
    try:
        out = box.commands.run("cat /srv/py.txt; echo $GREETING; pwd").stdout
        assert out.split("\n")[:3] == ["from-python", "hello world", "/srv"]
        r = _wait_port(sdk, box.get_host(8080), "/py.txt", timeout_s=5)
        assert r.status_code == 200 and r.text == "from-python\n"
    finally:
        box.kill()


def test_bad_builds_raise_build_exception(sdk: E2EService, registry: Registry,
                                          auth_registry: Registry,
                                          images: PushedImages) -> None:
    from e2b import Template
    from e2b.exceptions import BuildException

    cases = [
        (Template().from_template("base").run_cmd("echo failing-step-output; exit 7"),
         "failed to run command 'echo failing-step-output; exit 7': exit status 7"),
        # E2B's text, which its SDK suites match
        (Template().from_template("base").run_cmd("whoami", user="root123"),
         ("failed to run command 'whoami': command failed: unauthenticated: "
         "invalid username: 'root123'")),
        (Template().from_image(f"{registry.host}/nope:1"), "not found"),
        (Template().from_image(f"{auth_registry.host}/private/busybox:1",
                               username="alice", password="wrong"), "auth"),
    ]
    outputs: list[list[str]] = []
    for i, (t, why) in enumerate(cases):
        logs: list[str] = []
        with pytest.raises(BuildException) as err:
            Template.build(t, f"e2e-bad-{i}", on_build_logs=lambda e, lg=logs: lg.append(e.message))
        assert why in str(err.value).lower(), (str(err.value), logs)
        outputs.append(logs)
    assert "failing-step-output" in outputs[0]  # the failing step's output reached the logs
    with sdk.client() as c:  # no VM of a failed build is left running
        assert all(not s["templateID"].startswith("e2e-bad") for s in c.get("/v2/sandboxes")
                   .json())


@pytest.mark.js
def test_js_sdk_builds_templates(service: E2EService, registry: Registry,
                                 images: PushedImages, tmp_path: Path) -> None:
    if shutil.which("node") is None or not (JS / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    ctx = _context(tmp_path, "hello from js\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(service.sdk_env())
    env["E2B_DOMAIN"] = "sbx.localhost"
    r = subprocess.run(["node", str(JS / "templates.mjs"), str(ctx),
                        f"{registry.host}/busybox:1"], env=env, cwd=JS, capture_output=True,
                       text=True, timeout=900, check=False)
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
    assert r.returncode == 0, (out.get("error"), r.stderr[-2000:])
    assert out["run"].split("\n")[:4] == ["/app", "hi from js", "hi from js", "user"]
    assert "js-start-marker" in out["processes"]  # the start command's, through bash
    assert ("failed to run command 'whoami': command failed: unauthenticated: "
            "invalid username: 'root123'") in out["noUser"], out["noUser"]
    assert any("Ready" in m for m in out["logs"]), out["logs"]
    page = _wait_port(service, out["host"], "/index.html", timeout_s=5)
    assert page.status_code == 200 and page.text == "hello from js\n"
    assert out["busybox"].startswith("from-js\nBusyBox")
    page = _wait_port(service, out["busyboxHost"], "/js.txt", timeout_s=5)
    assert page.status_code == 200 and page.text == "from-js\n"
    with service.client() as c:
        for sid in (out["sandboxId"], out["busyboxId"]):
            c.delete(f"/sandboxes/{sid}")
