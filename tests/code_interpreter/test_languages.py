"""Every language of the code interpreter through the unmodified Python SDK (debug mode)
against the server process: the battery of languages.json (run, state, errors with
tracebacks, env vars at three levels, cwd, contexts, streaming, interrupt), plus what
E2B's own SDK tests ask of particular kernels (top-level await, ESM imports, the
default contexts)."""

from __future__ import annotations

from typing import Any

import pytest

from . import battery
from .conftest import SANDBOX_ENVS, CIServer

ci = pytest.importorskip("e2b_code_interpreter")
e2b = pytest.importorskip("e2b")


@pytest.mark.parametrize("language", battery.LANGUAGES)
def test_language_battery(sandbox: Any, ci_server: CIServer, language: str) -> None:
    other = ci_server.home / f"elsewhere-{language}"
    other.mkdir(exist_ok=True)
    battery.full(sandbox, language, home=str(ci_server.home), other_dir=str(other),
                 sandbox_env=("AENV_SANDBOX_VAR", SANDBOX_ENVS["AENV_SANDBOX_VAR"]),
                 timeout_exc=e2b.TimeoutException)


def test_default_contexts_include_python_and_javascript(sandbox: Any) -> None:
    languages = {c.language for c in sandbox.list_code_contexts()}
    assert {"python", "javascript"} <= languages


def test_js_top_level_await_and_esm_imports(sandbox: Any) -> None:
    execution = sandbox.run_code("await Promise.resolve('Hello World!')", language="js")
    assert execution.text == "Hello World!"
    execution = sandbox.run_code(
        "import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)", language="js")
    assert execution.logs.stdout == ["function\n"]


def test_typescript_types_are_checked_away(sandbox: Any) -> None:
    execution = sandbox.run_code(
        "interface P { x: number }\nconst p: P = { x: 41 }\np.x + 1", language="ts")
    assert execution.text == "42"


def test_language_and_context_together_are_refused(sandbox: Any) -> None:
    ctx = sandbox.create_code_context(language="python")
    with pytest.raises(e2b.InvalidArgumentException):
        sandbox.run_code("console.log(1)", language="js", context=ctx)


def test_env_values_are_literals_in_every_language(sandbox: Any) -> None:
    # quotes, backslashes and newlines in values reach the kernel as data, not code
    value = 'a "quoted" \\ value\nline two'
    for language in ("java", "javascript", "r", "bash", "python"):
        spec = battery.BATTERY[language]["env"]
        code = spec["code"].replace("@NAME@", "AENV_TRICKY")
        execution = sandbox.run_code(code, language=language, envs={"AENV_TRICKY": value})
        assert execution.error is None, f"{language}: {execution.error}"
        out = (execution.results[0].text if execution.results
               else "".join(execution.logs.stdout))
        assert "line two" in out and "quoted" in out, f"{language}: {out!r}"


def test_bash_variable_name_is_not_code(sandbox: Any, ci_server: CIServer) -> None:
    marker = ci_server.home / "injected"
    execution = sandbox.run_code("echo ran", language="bash",
                                 envs={f"$(touch {marker})": "v", "OK_VAR": "$(id)"})
    assert "".join(execution.logs.stdout).strip().endswith("ran")
    assert not marker.exists()
    value = sandbox.run_code('echo "$OK_VAR"', language="bash", envs={"OK_VAR": "$(id)"})
    assert value.logs.stdout == ["$(id)\n"]
