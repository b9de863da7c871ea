"""The languages this server runs: which kernel runs each, and the small pieces of code
the server sends a kernel of that language (set and unset environment variables).

| language   | kernel                                   | transport | interrupt | env vars        |
|------------|------------------------------------------|-----------|-----------|-----------------|
| python     | ipykernel (kernelside.main)              | ipc       | SIGINT    | os.environ      |
| javascript | Deno's Jupyter kernel (`deno` on PyPI)   | tcp       | message   | Deno.env        |
| typescript | the same Deno kernel (it runs TS itself) | tcp       | message   | Deno.env        |
| r          | IRkernel (Debian r-cran-irkernel)        | tcp       | SIGINT    | Sys.setenv      |
| java       | JJava on JShell (`jjava` on PyPI, a JDK) | tcp       | message   | System property |
| bash       | bash_kernel (PyPI)                       | ipc       | SIGINT    | export          |

Deno and JJava (JeroMQ) cannot bind IPC sockets, so those kernels listen on loopback TCP
(the channels are HMAC-signed with the per-kernel key either way). Java code cannot
change its own process environment: as on E2B, variables reach Java code as system
properties (`System.getProperty("NAME")`); the sandbox-wide ones are also in the real
environment of kernels started after the sandbox's creation.

Every literal is embedded as a JSON string, which JavaScript, R and Java read as the
same string literal (JSON escapes are a subset of theirs); bash gets shlex quoting.
Nothing the user sends is ever interpolated as code.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KernelError, RequestError

DEFAULT_LANGUAGE = "python"
# E2B's server starts with the default contexts of python and javascript (its lifespan),
# and the SDKs' users expect to see both listed. Only python's kernel starts with the
# server (so it is warm in the template's snapshot); javascript's starts on its first
# use: a Deno kernel holds ~200 MiB, which would triple an idle sandbox's memory
# (bench/bench_code_interpreter.py: 298 vs ~98 MiB used after create).
DEFAULT_CONTEXT_LANGUAGES = ("python", "javascript")
WARM_LANGUAGES = ("python",)
# the SDKs' spellings that E2B's server folds into one language
_ALIASES = {"js": "javascript", "ts": "typescript", "python3": "python", "py": "python",
            "sh": "bash", "shell": "bash"}
_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)
_PYTHON_LAUNCH = (f"import sys; sys.path.append({_PACKAGE_PARENT!r}); "
                  "from aenv_code_interpreter.kernelside import main; main()")
Env = Mapping[str, str]


def _lit(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class Language:
    """How to start a kernel for one language and talk to it about its environment."""

    name: str
    display_name: str
    transport: str                                   # "ipc" or "tcp"
    interrupt_mode: str                              # "signal" or "message"
    argv: Callable[[], list[str]]                    # "{connection_file}" is filled in
    set_env: Callable[[Env], str]
    unset_env: Callable[[Iterable[str]], str]
    # python only: the previous values of per-run variables are read back from the
    # kernel (user_expressions) and restored; elsewhere, as on E2B, a per-run variable
    # gets back its sandbox-wide value after the run, or is removed
    snapshots: bool = False
    # added to the kernel's environment
    env: Mapping[str, str] = field(default_factory=dict)
    # Deno's kernel publishes a cell's result (an op its JS side starts and does not
    # await) and its console output (a channel drained by another task) on their own
    # schedule, sometimes after the cell's `idle` (its server sleeps 5 ms and hopes).
    # For such a kernel an execution ends with a silent flush cell whose code, given a
    # marker, emits it through both paths; once both markers are back, every output of
    # the cell before it is too (execution.py)
    flush: Callable[[str], str] | None = None


def _which(program: str, what: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise KernelError(f"cannot start a {what} kernel: `{program}` is not installed in "
                          "this sandbox (the code-interpreter-v1 template has it)")
    return path


def _python_argv() -> list[str]:
    return [sys.executable, "-c", _PYTHON_LAUNCH, "-f", "{connection_file}"]


def _deno_argv() -> list[str]:
    try:
        from deno import find_deno_bin
        deno = find_deno_bin()
    except (ImportError, FileNotFoundError):
        deno = _which("deno", "JavaScript")
    return [deno, "jupyter", "--kernel", "--conn", "{connection_file}"]


def _r_argv() -> list[str]:
    return [_which("R", "R"), "--slave", "-e", "IRkernel::main()", "--args",
            "{connection_file}"]


def _java_argv() -> list[str]:
    try:
        import jjava
    except ImportError as exc:
        raise KernelError("cannot start a Java kernel: the jjava package is missing") from exc
    # pip puts the wheel's data files beside the package root: <site>/share/jupyter/...
    jars = Path(jjava.__file__).resolve().parent.parent / "share" / "jupyter" / "kernels" / "java"
    if not (jars / "jjava.jar").is_file():
        raise KernelError(f"cannot start a Java kernel: {jars}/jjava.jar is missing")
    # what JJava's launcher jar would run, without a second JVM in front of it (whose
    # death would orphan the kernel): the kernel needs jdk.jshell opened to it
    opts = os.environ.get("JJAVA_JVM_OPTS", "").split() or list(_JAVA_DEFAULT_OPTS)
    return [_which("java", "Java"), "--add-opens", "jdk.jshell/jdk.jshell=ALL-UNNAMED",
            *opts, "-jar", str(jars / "jjava.jar"), "{connection_file}"]


# C1 only and the serial collector: a kernel answers its first cell 2.7x sooner (54 s ->
# 20 s for JShell in a one-vCPU TCG guest; C2 compiling in the background competes with
# the cell for the only CPU), which matters more for notebook cells than peak speed.
# JJAVA_JVM_OPTS in the server's environment replaces these, as with JJava's launcher.
_JAVA_DEFAULT_OPTS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")


def _bash_argv() -> list[str]:
    return [sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"]


def _python_set(env: Env) -> str:
    return f"__import__('os').environ.update({dict(env)!r})"


def _python_unset(keys: Iterable[str]) -> str:
    return f"[__import__('os').environ.pop(k, None) for k in {list(keys)!r}]"


def _lines(template: str, items: Iterable[tuple[str, ...]]) -> str:
    return "\n".join(template.format(*(_lit(x) for x in item)) for item in items)


def _setter(template: str) -> Callable[[Env], str]:
    return lambda env: _lines(template, env.items())


def _unsetter(template: str) -> Callable[[Iterable[str]], str]:
    return lambda keys: _lines(template, ((k,) for k in keys))


def _bash_set(env: Env) -> str:
    # the whole assignment is one quoted word: a name like `$(cmd)` stays text (bash
    # then refuses it as "not a valid identifier")
    return "\n".join(f"export {shlex.quote(f'{k}={v}')}" for k, v in env.items())


def _bash_unset(keys: Iterable[str]) -> str:
    return "\n".join(f"unset -v -- {shlex.quote(k)}" for k in keys)


def _deno_flush(marker: str) -> str:
    return (f"console.log({_lit(marker)});\n"
            f"await Deno.jupyter.display({{'text/plain': {_lit(marker)}}}, {{raw: true}});")


_DENO = (_setter("Deno.env.set({}, {});"), _unsetter("Deno.env.delete({});"))

LANGUAGES: dict[str, Language] = {lang.name: lang for lang in (
    Language("python", "Python 3", "ipc", "signal", _python_argv, _python_set,
             _python_unset, snapshots=True),
    # Deno colours its text/plain results unless NO_COLOR is set
    Language("javascript", "JavaScript (Deno)", "tcp", "message", _deno_argv, *_DENO,
             env={"NO_COLOR": "1"}, flush=_deno_flush),
    Language("typescript", "TypeScript (Deno)", "tcp", "message", _deno_argv, *_DENO,
             env={"NO_COLOR": "1"}, flush=_deno_flush),
    Language("r", "R", "tcp", "signal", _r_argv, _setter("invisible(Sys.setenv({} = {}))"),
             _unsetter("invisible(Sys.unsetenv({}))")),
    Language("java", "Java (JJava)", "tcp", "message", _java_argv,
             _setter("System.setProperty({}, {});"), _unsetter("System.clearProperty({});")),
    Language("bash", "Bash", "ipc", "signal", _bash_argv, _bash_set, _bash_unset),
)}


def normalize_language(language: str | None) -> str:
    """The canonical name of `language` (None or blank means python); RequestError if
    this server has no kernel for it."""
    name = (language or "").strip().lower() or DEFAULT_LANGUAGE
    name = _ALIASES.get(name, name)
    if name not in LANGUAGES:
        raise RequestError(f"Unsupported language {language!r}: this code interpreter runs "
                           f"{', '.join(LANGUAGES)}")
    return name
