"""The unmodified `e2b-code-interpreter` SDKs (Python from PyPI, JS from npm) against the
real service and real VMs: `code-interpreter-v1` is built on first use from the built-in
recipe (host/builtin/recipes.py) through the template build pipeline, and its sandboxes
run our server (templates/code-interpreter/) with a warm Jupyter kernel.

One template build per session (module fixture); the sandboxes share it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.code_interpreter import battery
from tests.code_interpreter import charts as figures
from tests.orchestrator.hostproc import REPO

from .conftest import E2EService, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]

TEMPLATE = "code-interpreter-v1"
JS = REPO / "tests" / "js"


@pytest.fixture(scope="module")
def ci(service: E2EService) -> Iterator[E2EService]:
    """The service with code-interpreter-v1 built (by the first create naming it) and
    the SDKs' env set."""
    with service.client() as c:
        t0 = time.monotonic()
        r = c.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 60},
                   timeout=httpx.Timeout(3000.0))
        took = time.monotonic() - t0
        assert r.status_code == 201, r.text
        c.delete(f"/sandboxes/{r.json()['sandboxID']}")
    print(f"\ncode-interpreter-v1: first create (build on first use + start) {took:.1f}s")
    with pytest.MonkeyPatch.context() as mp:
        use_sdk(service, mp)
        yield service


@pytest.fixture(scope="module")
def box(ci: E2EService):
    from e2b_code_interpreter import Sandbox

    # request_timeout: a restarted context answers once its new kernel is up (a JVM
    # under TCG takes a while)
    sbx = Sandbox.create(timeout=1800, envs={"SBX_WIDE": "sandbox-wide"}, request_timeout=600)
    yield sbx
    sbx.kill()


def test_template_is_listed_and_default(ci: E2EService) -> None:
    from e2b_code_interpreter import Sandbox

    assert Sandbox.default_template == TEMPLATE  # what Sandbox.create() asks for
    with ci.client() as c:
        names = [a for t in c.get("/templates").json() for a in t["aliases"]]
    assert TEMPLATE in names


def test_state_kept_between_runs(box) -> None:
    """Also: a str result's text has its quotes stripped, as E2B's server does."""
    first = box.run_code("x = 41")
    assert first.error is None and first.results == []
    second = box.run_code("x + 1")
    assert second.text == "42"
    assert second.execution_count is not None and first.execution_count is not None
    assert second.execution_count > first.execution_count
    assert box.run_code("import os; os.getcwd()").text == "/home/user"
    assert box.run_code("import getpass; getpass.getuser()").text == "user"


def test_matplotlib_plot_is_png(box) -> None:
    ex = box.run_code("import matplotlib.pyplot as plt\n"
                      "plt.plot([1, 2, 3], [1, 4, 9])\nplt.title('squares')\nplt.show()")
    assert ex.error is None, ex.error
    pngs = [r.png for r in ex.results if r.png]
    assert pngs, ex.results
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
    assert not any(r.is_main_result for r in ex.results if r.png)


def test_rich_results_and_data_stack(box) -> None:
    ex = box.run_code("import pandas as pd, numpy as np\n"
                      "df = pd.DataFrame({'a': np.arange(3), 'b': list('xyz')})\ndf")
    assert ex.error is None, ex.error
    main = [r for r in ex.results if r.is_main_result]
    assert len(main) == 1 and "<table" in (main[0].html or "") and "x" in main[0].text
    ex = box.run_code("from IPython.display import JSON, display\n"
                      "display(JSON({'k': [1, 2]}))")
    assert [r.json for r in ex.results] == [{"k": [1, 2]}]


def test_error_has_name_value_traceback(box) -> None:
    ex = box.run_code("def f():\n    raise ValueError('boom 17')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError" and ex.error.value == "boom 17"
    assert "boom 17" in ex.error.traceback and "f()" in ex.error.traceback
    # the kernel is still usable afterwards
    assert box.run_code("1 + 1").text == "2"


def test_stdout_streams_while_code_runs(box) -> None:
    """The code prints, then waits for a file that only the on_stdout callback creates:
    without streaming, the callback would come after the run and the code would give up."""
    box.files.write("/home/user/.go", "")
    box.commands.run("rm -f /home/user/.go")
    seen: list[str] = []

    def on_stdout(msg) -> None:
        seen.append(msg.line)
        if msg.line.startswith("waiting"):
            box.files.write("/home/user/.go", "go")

    ex = box.run_code(
        "import os, time, sys\nprint('waiting', flush=True)\n"
        "for _ in range(600):\n"
        "    if os.path.exists('/home/user/.go'): print('got go'); break\n"
        "    time.sleep(0.1)\n"
        "else:\n    print('gave up')", on_stdout=on_stdout)
    assert ex.error is None, ex.error
    assert "".join(ex.logs.stdout) == "waiting\ngot go\n"
    assert "".join(seen) == "waiting\ngot go\n"


def test_stderr_and_env_vars(box) -> None:
    ex = box.run_code("import sys; print('to err', file=sys.stderr)")
    assert "".join(ex.logs.stderr) == "to err\n"
    assert box.run_code("import os; os.environ.get('SBX_WIDE')").text == "sandbox-wide"
    per_run = box.run_code("import os; os.environ.get('ONE_RUN')", envs={"ONE_RUN": "yes"})
    assert per_run.text == "yes"
    after = box.run_code("import os; repr(os.environ.get('ONE_RUN'))")
    assert after.text == "None"


def test_contexts_are_isolated(box) -> None:
    ctx = box.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    try:
        box.run_code("secret = 'in-ctx'", context=ctx)
        assert box.run_code("secret", context=ctx).text == "in-ctx"
        assert box.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"
        other = box.run_code("secret")
        assert other.error is not None and other.error.name == "NameError"
        assert ctx.id in [c.id for c in box.list_code_contexts()]
        box.restart_code_context(ctx)
        gone = box.run_code("secret", context=ctx)
        assert gone.error is not None and gone.error.name == "NameError"
    finally:
        box.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in box.list_code_contexts()]


def test_timeout_interrupts_the_kernel(box) -> None:
    from e2b import TimeoutException

    box.run_code("interrupted = True")
    with pytest.raises(TimeoutException):
        box.run_code("import time\ntime.sleep(300)\ninterrupted = False", timeout=5)
    # had the kernel not been interrupted, this would wait for the sleep to end and then
    # read False
    assert box.run_code("interrupted").text == "True"
    assert box.run_code("x + 1").text == "42"


@pytest.mark.parametrize("language", battery.LANGUAGES)
def test_every_language(box, language: str) -> None:
    """The battery of tests/code_interpreter/languages.json in a real VM: run, state,
    errors, env vars at three levels (SBX_WIDE is the sandbox's), cwd, contexts,
    streaming and a timeout that interrupts the kernel, per language."""
    from e2b import TimeoutException

    battery.full(box, language, home="/home/user", other_dir="/tmp",
                 sandbox_env=("SBX_WIDE", "sandbox-wide"), timeout_exc=TimeoutException)
    assert language in {c.language for c in box.list_code_contexts()}


def test_charts_and_saved_images(box) -> None:
    from e2b_code_interpreter import charts

    figures.check_all(box, charts)
    figures.check_saved_images(box)


def _node(ci: E2EService, *args: str) -> dict:
    """Run a tests/js script against the service; its last line (a JSON summary)."""
    if shutil.which("node") is None or not (JS / "node_modules" / "@e2b" /
                                            "code-interpreter").exists():
        pytest.skip("node or tests/js/node_modules/@e2b/code-interpreter missing "
                    "(npm ci in tests/js)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(ci.sdk_env())
    env["E2B_DOMAIN"] = "sbx.localhost"
    r = subprocess.run(["node", *args], env=env, cwd=JS, capture_output=True,
                       text=True, timeout=1800, check=False)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


# The JS SDK's battery in a VM: the SDK's side is the same for every language (it sends a
# name and parses one protocol), and every language already ran in a VM above (Python SDK)
# and through the JS SDK against the server on the host (tests/code_interpreter); here
# three kernels (ipykernel, Deno over TCP, bash_kernel) prove the SDK's path into a guest.
# The JVM and R cold starts a second time would cost CI ~3 minutes for nothing more.
JS_IN_VM = ("python", "javascript", "bash")


@pytest.mark.js
def test_js_sdk_battery_in_a_vm(ci: E2EService) -> None:
    """The battery through the JS SDK, in a sandbox of its own (created by the script
    with SBX_WIDE)."""
    assert set(JS_IN_VM) < set(battery.LANGUAGES)
    summary = _node(ci, "code_interpreter_languages.mjs", "/home/user", "/tmp",
                    "SBX_WIDE=sandbox-wide", *JS_IN_VM)
    assert summary == {language: True for language in JS_IN_VM}


def test_state_survives_pause_and_resume(ci: E2EService) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        sbx.run_code("kept = [1, 2, 3]\nimport numpy as np\narr = np.arange(5)")
        sid = sbx.sandbox_id
        assert sbx.pause()
        again = Sandbox.connect(sid, timeout=600)
        assert again.run_code("sum(kept) + int(arr.sum())").text == "16"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_fork_children_keep_kernel_state(ci: E2EService) -> None:
    from e2b_code_interpreter import Sandbox

    parent = Sandbox.create(timeout=600)
    kids: list = []
    try:
        parent.run_code("base = 100")
        kids = [k for k in parent.fork(count=2, timeout=300) if isinstance(k, Sandbox)]
        assert len(kids) == 2
        for i, k in enumerate(kids):
            assert k.run_code(f"base += {i + 1}\nbase").text == str(101 + i)
        assert parent.run_code("base").text == "100"
    finally:
        for s in [parent, *kids]:
            s.kill()


@pytest.mark.js
def test_js_code_interpreter_sdk(ci: E2EService) -> None:
    out = _node(ci, "code_interpreter.mjs")
    assert out["answer"] == "42", out
    assert out["png"] is True and out["errorName"] == "ValueError", out
    assert out["isolated"] is True, out
