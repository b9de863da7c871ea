"""The unmodified e2b-code-interpreter Python SDK (debug mode) against the server."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from .conftest import CIServer

ci = pytest.importorskip("e2b_code_interpreter")
e2b = pytest.importorskip("e2b")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_state_persists_between_runs(sandbox: Any) -> None:
    first = sandbox.run_code("x = 41")
    assert first.error is None and first.results == []
    execution = sandbox.run_code("x + 1")
    assert execution.text == "42"
    assert execution.results[0].is_main_result
    assert execution.execution_count == first.execution_count + 1


def test_logs_and_string_results(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n'a string'")
    assert "".join(execution.logs.stdout) == "to out\n"
    assert "".join(execution.logs.stderr) == "to err\n"
    assert execution.text == "a string"     # the repr's quotes are stripped, as on E2B


def test_matplotlib_figure_is_png(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    assert execution.error is None
    pngs = [r for r in execution.results if r.png]
    assert len(pngs) == 1 and not pngs[0].is_main_result
    assert base64.b64decode(pngs[0].png).startswith(PNG_MAGIC)


def test_dataframe_has_data_and_html(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', None]})")
    result = execution.results[0]
    assert result.is_main_result and "<table" in result.html
    assert result.data == {"a": [1, 2], "b": ["x", None]}


def test_error_has_name_value_traceback(sandbox: Any) -> None:
    seen: list[Any] = []
    execution = sandbox.run_code(
        "def explode():\n    raise ValueError('boom 17')\nexplode()", on_error=seen.append)
    err = execution.error
    assert err is not None and seen == [err]
    assert (err.name, err.value) == ("ValueError", "boom 17")
    assert "raise ValueError('boom 17')" in err.traceback
    assert "\x1b[" not in err.traceback          # plain text, no terminal colours


def test_on_stdout_streams_while_code_runs(sandbox: Any, ci_server: CIServer,
                                           tmp_path: Path) -> None:
    # The code waits for a file that only the on_stdout callback creates: it can finish
    # with "marker seen" only if its first line reached the client while it still ran.
    marker = tmp_path / "first-line-arrived"
    events: list[str] = []

    def on_stdout(msg: Any) -> None:
        events.append(msg.line)
        marker.touch()

    code = (f"import os, time\nprint('first', flush=True)\n"
            f"for _ in range(600):\n"
            f"    if os.path.exists({str(marker)!r}): break\n"
            f"    time.sleep(0.05)\n"
            f"print('marker seen' if os.path.exists({str(marker)!r}) else 'no marker')")
    execution = sandbox.run_code(code, on_stdout=on_stdout)
    events.append("run_code returned")
    assert events == ["first\n", "marker seen\n", "run_code returned"]
    assert isinstance(execution.logs.stdout, list)


def test_timeout_interrupts_the_kernel(sandbox: Any) -> None:
    sandbox.run_code("kept = 'survives'\ninterrupted = False")
    code = ("import time\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    interrupted = True\n    raise")
    with pytest.raises(e2b.TimeoutException):
        sandbox.run_code(code, timeout=2)
    # The SDK closed the connection; the server interrupted the sleep, so the context
    # is free again and kept its state.
    after = sandbox.run_code("(kept, interrupted)")
    assert after.error is None
    assert after.text == "('survives', True)"


def test_env_vars_apply_to_one_run(sandbox: Any) -> None:
    code = "import os\nprint(os.environ.get('AENV_RUN_VAR'), os.environ.get('AENV_OWN_VAR'))"
    sandbox.run_code("import os\nos.environ['AENV_OWN_VAR'] = 'mine'")
    during = sandbox.run_code(code, envs={"AENV_RUN_VAR": "one", "AENV_OWN_VAR": "theirs"})
    assert during.logs.stdout == ["one theirs\n"]
    after = sandbox.run_code(code)
    assert after.logs.stdout == ["None mine\n"]      # removed, and restored


def test_sandbox_env_vars_from_envd(sandbox: Any) -> None:
    code = "import os\nprint(os.environ['AENV_SANDBOX_VAR'], os.environ['AENV_SHARED_VAR'])"
    assert sandbox.run_code(code).logs.stdout == ["from-envd sandbox-wide\n"]
    # a per-run value wins over the sandbox-wide one, which comes back afterwards
    over = sandbox.run_code(code, envs={"AENV_SHARED_VAR": "per-run"})
    assert over.logs.stdout == ["from-envd per-run\n"]
    assert sandbox.run_code(code).logs.stdout == ["from-envd sandbox-wide\n"]


def test_contexts_are_isolated_and_managed(sandbox: Any, ci_server: CIServer) -> None:
    workdir = ci_server.home / "project"
    workdir.mkdir(exist_ok=True)
    ctx = sandbox.create_code_context(cwd=str(workdir))
    assert (ctx.language, ctx.cwd) == ("python", str(workdir))
    try:
        assert sandbox.run_code("import os; os.getcwd()", context=ctx).text == str(workdir)
        sandbox.run_code("only_here = 1", context=ctx)
        assert sandbox.run_code("only_here", context=ctx).text == "1"
        other = sandbox.run_code("only_here")
        assert other.error is not None and other.error.name == "NameError"

        listed = {c.id: c for c in sandbox.list_code_contexts()}
        assert ctx.id in listed and listed[ctx.id].cwd == str(workdir)
        assert any(c.id != ctx.id and c.language == "python" for c in listed.values())

        sandbox.restart_code_context(ctx)
        gone = sandbox.run_code("only_here", context=ctx)
        assert gone.error is not None and gone.error.name == "NameError"
        assert sandbox.run_code("import os; os.getcwd()", context=ctx).text == str(workdir)
    finally:
        sandbox.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sandbox.list_code_contexts()}
    with pytest.raises(e2b.NotFoundException):
        sandbox.run_code("1", context=ctx)


def test_unknown_context_is_not_found(sandbox: Any) -> None:
    ghost = ci.Context(context_id="no-such-context", language="python", cwd="/")
    with pytest.raises(e2b.NotFoundException, match="no-such-context"):
        sandbox.run_code("1", context=ghost)
    with pytest.raises(e2b.NotFoundException):
        sandbox.restart_code_context("no-such-context")
    with pytest.raises(e2b.NotFoundException):
        sandbox.remove_code_context("no-such-context")


def test_unsupported_language_is_refused(sandbox: Any) -> None:
    with pytest.raises(e2b.SandboxException,
                       match="Unsupported language 'cobol'.*python, javascript"):
        sandbox.run_code("1", language="cobol")
    with pytest.raises(e2b.SandboxException, match="400"):
        sandbox.create_code_context(language="fortran")
    assert sandbox.run_code("6 * 7", language="python").text == "42"


async def test_async_sdk(ci_server: CIServer, sdk_env: None) -> None:
    sbx = await ci.AsyncSandbox.create()
    lines: list[str] = []
    execution = await sbx.run_code("print('async out')\n6 * 7",
                                   on_stdout=lambda m: lines.append(m.line))
    assert (execution.text, lines) == ("42", ["async out\n"])
    await sbx.run_code("async_kept = 1")
    with pytest.raises(e2b.TimeoutException):
        await sbx.run_code("import time; time.sleep(60)", timeout=2)
    assert (await sbx.run_code("async_kept + 1")).text == "2"
