"""The per-language battery (languages.json) driven through the Python SDK's sync Sandbox.

One function per behaviour the code-interpreter SDKs expose for every language: a run and
its stdout, state across runs, an error with its traceback, environment variables at the
three levels (sandbox-wide, per run, per run over a sandbox-wide one), the cwd of a
context, streaming callbacks, an interrupted run (the SDK's timeout), contexts (create,
list, restart, remove). Used by tests/code_interpreter (a server process on this
machine) and tests/e2e/test_code_interpreter.py (real VMs through the service).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# what a run that may start a kernel gets (a JVM under TCG takes a while to come up)
SLOW_S = 600.0
BATTERY: dict[str, Any] = json.loads(
    (Path(__file__).with_name("languages.json")).read_text())
LANGUAGES = [name for name in BATTERY if not name.startswith("_")]


def _fill(template: str, **values: str) -> str:
    for key, value in values.items():
        template = template.replace(f"@{key.upper()}@", value)
    return template


def _stdout(execution: Any) -> str:
    return "".join(execution.logs.stdout)


def _check_output(execution: Any, spec: dict[str, Any], **values: str) -> None:
    """`spec`'s `text` against the first result's text, or its `stdout` against stdout."""
    assert execution.error is None, f"{execution.error}"
    if "text" in spec:
        texts = [r.text for r in execution.results if r.text is not None]
        assert texts and texts[0].strip() == _fill(spec["text"], **values), \
            f"results {execution.results}, stdout {execution.logs.stdout}"
    else:
        assert _stdout(execution) == _fill(spec["stdout"], **values), f"{execution.logs}"


def run_and_state(sbx: Any, language: str, context: Any = None) -> None:
    b = BATTERY[language]
    where: dict[str, Any] = ({"context": context} if context is not None
                             else {"language": language})
    hello = sbx.run_code(b["hello"]["code"], timeout=SLOW_S, request_timeout=SLOW_S, **where)
    assert hello.error is None and _stdout(hello) == b["hello"]["stdout"], f"{hello}"
    assert sbx.run_code(b["state"]["set"], **where).error is None
    _check_output(sbx.run_code(b["state"]["get"], **where), b["state"])


def error(sbx: Any, language: str) -> None:
    b = BATTERY[language]["error"]
    seen: list[Any] = []
    execution = sbx.run_code(b["code"], language=language, on_error=seen.append)
    err = execution.error
    assert err is not None and seen == [err], f"{execution}"
    assert err.name == b["name"] and b["value"] in err.value, f"{err}"
    assert b["traceback"] in err.traceback and "\x1b[" not in err.traceback, f"{err}"


def env_vars(sbx: Any, language: str, sandbox_env: tuple[str, str] | None) -> None:
    """Per-run variables apply to that run only; a sandbox-wide one (NAME, VALUE) is seen
    in every run and comes back after a per-run overwrite."""
    spec = BATTERY[language]["env"]

    def read(name: str, expected: str, **kwargs: Any) -> None:
        execution = sbx.run_code(_fill(spec["code"], name=name), language=language, **kwargs)
        _check_output(execution, spec, value=expected)

    read("AENV_PER_RUN", "per run value", envs={"AENV_PER_RUN": "per run value"})
    read("AENV_PER_RUN", "default")
    if sandbox_env is not None:
        name, value = sandbox_env
        read(name, value)
        read(name, "overwritten", envs={name: "overwritten"})
        read(name, value)


def cwd_and_contexts(sbx: Any, language: str, home: str, other_dir: str) -> None:
    """The default context runs in `home`, a created one in its own cwd with its own
    state; contexts are listed, restarted (state lost) and removed."""
    b = BATTERY[language]
    _check_output(sbx.run_code(b["cwd"]["code"], language=language), b["cwd"], cwd=home)
    ctx = sbx.create_code_context(language=language, cwd=other_dir, request_timeout=SLOW_S)
    try:
        assert (ctx.language, ctx.cwd) == (language, other_dir)
        _check_output(sbx.run_code(b["cwd"]["code"], context=ctx), b["cwd"], cwd=other_dir)
        listed = {c.id: c for c in sbx.list_code_contexts()}
        assert listed[ctx.id].language == language
        run_and_state(sbx, language, ctx)
        sbx.restart_code_context(ctx)   # the sandbox's request_timeout bounds it
        after = sbx.run_code(b["state"]["get"], context=ctx, timeout=SLOW_S)
        # the variable is gone: an error, or (bash) an empty expansion
        assert after.error is not None or _stdout(after) != b["state"].get("stdout"), \
            f"{after}"
    finally:
        sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}


def streaming(sbx: Any, language: str) -> None:
    b = BATTERY[language]["stream"]
    lines: list[str] = []
    execution = sbx.run_code(b["code"], language=language,
                             on_stdout=lambda m: lines.append(str(m.line)))
    assert execution.error is None, f"{execution.error}"
    # kernels chunk output their own way: the callbacks carry the lines, in order
    assert "".join(lines) == "".join(b["stdout"]), lines


def interrupt(sbx: Any, language: str, timeout_exc: type[BaseException]) -> None:
    """A run cut by the SDK's timeout interrupts the kernel; the context keeps its state
    and runs the next code at once."""
    b = BATTERY[language]
    assert sbx.run_code(b["state"]["set"], language=language).error is None
    try:
        sbx.run_code(b["sleep"], language=language, timeout=3)
    except timeout_exc:
        pass
    else:
        raise AssertionError(f"{language}: the 120 s run was not cut by the 3 s timeout")
    _check_output(sbx.run_code(b["state"]["get"], language=language), b["state"])


def full(sbx: Any, language: str, *, home: str, other_dir: str,
         sandbox_env: tuple[str, str] | None, timeout_exc: type[BaseException]) -> None:
    run_and_state(sbx, language)
    error(sbx, language)
    env_vars(sbx, language, sandbox_env)
    cwd_and_contexts(sbx, language, home, other_dir)
    streaming(sbx, language)
    interrupt(sbx, language, timeout_exc)
