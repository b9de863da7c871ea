"""`aenv build`, `aenv template build|ls|rm` and `aenv pull` against the real REST API on
a real `NodeOrchestrator` whose runtime is the fake (no VM; tests/api/template_service.py).
The builds run in the real e2b SDK inside `aenv`: Dockerfile conversion, COPY hashing and
upload over HTTP, build start, status and log polling. Progress output under a real pty
(live status line) and through a pipe (plain lines, no ANSI codes)."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import e2b
import httpx
import pytest
from click.testing import CliRunner

from host.cli import CliError, cli
from host.cli.builder import sdk_errors
from host.contract import BuildFailed, BuildSpec, RegistryAuth
from tests.api.conftest import free_port

from .conftest import REPO_ROOT, TemplateStack

DOCKERFILE = """\
FROM e2bdev/base
ENV GREETING=hello
WORKDIR /app
COPY a.txt /app/
RUN echo built > /app/built.txt
CMD ["python3", "-m", "http.server", "8000"]
"""
ANSI = re.compile(r"\x1b[\[\]()]")


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "a.txt").write_text("hello\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    return ctx


def wrap_build(tstack: TemplateStack, monkeypatch: pytest.MonkeyPatch,
               before: Callable[[BuildSpec, Callable[..., None]], Any]) -> None:
    """The fake runtime's build, with `before(spec, log)` run (and awaited, if it returns
    an awaitable) first; it may raise."""
    original = tstack.svc.runtime.build

    async def build(spec: BuildSpec, log: Callable[..., None]) -> Any:
        result = before(spec, log)
        if inspect.isawaitable(result):
            await result
        return await original(spec, log)

    monkeypatch.setattr(tstack.svc.runtime, "build", build)


def test_build_dockerfile(tstack: TemplateStack, context: Path) -> None:
    r = tstack.run("build", str(context / "Dockerfile"), "--name", "web")
    assert r.exit_code == 0, r.output
    (spec,) = tstack.svc.runtime.build_specs
    assert spec.from_image == "e2bdev/base" and spec.from_snapshot is None
    steps = [(s.type, s.args) for s in spec.steps]
    assert steps == [("USER", ("root",)), ("WORKDIR", ("/",)), ("ENV", ("GREETING", "hello")),
                     ("WORKDIR", ("/app",)), ("COPY", ("a.txt", "/app/", "", "")),
                     ("RUN", ("echo built > /app/built.txt",)), ("USER", ("user",))]
    assert spec.start_cmd == "python3 -m http.server 8000" and spec.ready_cmd == "sleep 20"
    assert not spec.force and spec.machine.cpu_count >= 1
    # the COPY source went up as a gzipped tar, under its files hash
    files_hash = spec.steps[4].files_hash
    assert files_hash is not None
    archive = tstack.svc.files_dir / files_hash
    with tarfile.open(fileobj=io.BytesIO(archive.read_bytes()), mode="r:gz") as tar:
        member = tar.extractfile("a.txt")
        assert member is not None and member.read() == b"hello\n"
    # the log streamed as plain lines (no terminal here), then the result
    out = r.stdout
    assert not ANSI.search(r.output)
    assert re.search(r"^\d\d:\d\d:\d\d Requesting build for template: web$", out,
                     re.MULTILINE)
    assert "Uploaded 'a.txt'" in out and "FROM e2bdev/base" in out and "RUN echo built" in out
    assert "Build started" not in out  # debug entries are not shown
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"Built web: template \w+, build [0-9a-f-]{36}, tags default", last)


def test_template_build_of_a_directory_with_options_and_json(
        tstack: TemplateStack, context: Path) -> None:
    r = tstack.run("template", "build", str(context), "-n", "web:v1", "--tag", "stable",
                   "--cpu", "2", "--memory-mb", "1024", "--skip-cache", "-o", "json")
    assert r.exit_code == 0, r.output
    built = json.loads(r.stdout)  # stdout holds only the result...
    assert set(built) == {"templateID", "buildID", "name", "tags"}
    assert built["name"] == "web:v1" and sorted(built["tags"]) == ["stable", "v1"]
    assert "Uploaded 'a.txt'" in r.stderr  # ... the log went to stderr
    (spec,) = tstack.svc.runtime.build_specs
    assert spec.force and (spec.machine.cpu_count, spec.machine.memory_mb) == (2, 1024)

    # the same files again: the SDK finds them present and skips the upload
    r = tstack.run("build", str(context), "--name", "web:v2")
    assert r.exit_code == 0, r.output
    assert "Skipping upload of 'a.txt', already cached" in r.stdout


def test_pull_with_start_and_ready_commands(tstack: TemplateStack,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def blobs(spec: BuildSpec, log: Callable[..., None]) -> None:
        log("info", f"Pulling {spec.from_image}", "base")
        log("info", "copying blob sha256:" + "a" * 64, "base")

    wrap_build(tstack, monkeypatch, blobs)
    r = tstack.run("pull", "busybox", "--name", "b", "--start-cmd", "httpd -f -p 8000",
                   "--ready-cmd", "wget -q -O- localhost:8000")
    assert r.exit_code == 0, r.output
    (spec,) = tstack.svc.runtime.build_specs
    assert spec.from_image == "busybox" and spec.registry is None and spec.steps == ()
    assert spec.start_cmd == "httpd -f -p 8000"
    assert spec.ready_cmd == "wget -q -O- localhost:8000"
    assert "Pulling busybox" in r.stdout and "copying blob sha256:aaaa" in r.stdout

    # only a start command: E2B's default ready command; registry credentials from stdin
    r = tstack.run("pull", "registry.example/private/app:1", "--name", "app", "--start-cmd",
                   "/app/run", "--username", "me", "--password-stdin", "-o", "json",
                   stdin="s3cret\n")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["name"] == "app"
    spec = tstack.svc.runtime.build_specs[-1]
    assert spec.from_image == "registry.example/private/app:1"
    assert spec.registry == RegistryAuth(username="me", password="s3cret")
    assert (spec.start_cmd, spec.ready_cmd) == ("/app/run", "sleep 20")
    assert "s3cret" not in r.output


def test_pull_errors(tstack: TemplateStack, monkeypatch: pytest.MonkeyPatch) -> None:
    def registry(spec: BuildSpec, log: Callable[..., None]) -> None:
        if spec.from_image == "nosuch/image":
            raise BuildFailed("pulling docker.io/nosuch/image:latest: manifest unknown",
                              step="base")
        if spec.registry is not None and spec.registry.password != "right":
            raise BuildFailed("pulling private/app: unauthorized: authentication required",
                              step="base")

    wrap_build(tstack, monkeypatch, registry)
    cases = [
        (("pull", "nosuch/image", "--name", "x"), None,
         "aenv: build failed: pulling docker.io/nosuch/image:latest: manifest unknown"),
        (("pull", "private/app", "--name", "y", "--username", "me", "--password-stdin"),
         "wrong\n", ("aenv: build failed: pulling private/app: unauthorized: "
                    "authentication required")),
    ]
    for args, stdin, line in cases:
        r = tstack.run(*args, stdin=stdin)
        assert r.exit_code == 1, r.output
        assert r.stderr.strip() == line
    # a bad API key: the API's 401, exit 3
    r = tstack.run("pull", "busybox", "--name", "z", key="wrong")
    assert r.exit_code == 3, r.output
    assert r.stderr.startswith("aenv: API error 401: ")
    assert len(r.stderr.strip().splitlines()) == 1
    r = tstack.run("pull", "busybox", "--name", "z", key=None)  # no key anywhere
    assert r.exit_code == 3
    assert r.stderr == "aenv: no API key: run `aenv auth login` or set E2B_API_KEY\n"
    url = f"http://127.0.0.1:{free_port()}"
    r = CliRunner().invoke(cli, ["--api-url", url, "--api-key", "k", "pull", "busybox",
                                 "--name", "z"])
    assert r.exit_code == 1
    assert r.stderr.startswith(f"aenv: cannot reach the API at {url} (")
    assert r.stderr.endswith("or set --api-url / run `aenv auth login`\n")
    assert len(r.stderr.strip().splitlines()) == 1
    # usage errors: exit 2
    for args in (("pull", "busybox"), ("pull", "busybox", "--name", "u", "--username", "me"),
                 ("pull", "busybox", "--name", "u", "--password-stdin")):
        r = tstack.run(*args, stdin="pw\n")
        assert r.exit_code == 2, (args, r.output)


def test_failing_build_exits_with_the_steps_message(tstack: TemplateStack,
                                                    tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile.broken"
    dockerfile.write_text("FROM e2bdev/base\nRUN echo ok\nRUN exit 1\n")
    r = tstack.run("build", str(dockerfile), "--name", "broken")
    assert r.exit_code == 1, r.output
    assert r.stderr.strip() == "aenv: build failed: Command 'exit 1' failed with exit code 1"
    assert "error: exit status 1" in r.stdout  # the failing step's log line
    assert "Traceback" not in r.output


def test_bad_dockerfiles(tstack: TemplateStack, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    multi = tmp_path / "multi"
    multi.write_text("FROM a AS one\nFROM b\n")
    nocopy = tmp_path / "nocopy"
    nocopy.write_text("FROM e2bdev/base\nCOPY missing.txt /x\n")
    cases = {str(tmp_path / "nope"): f"aenv: {tmp_path / 'nope'}: no such file or directory",
             str(tmp_path / "empty"): f"aenv: no Dockerfile in {tmp_path / 'empty'}",
             str(multi): f"aenv: {multi}: Dockerfile parse error: Multi-stage Dockerfiles "
                         "are not supported",
             str(nocopy): f"aenv: No files found in {tmp_path}/missing.txt"}
    for path, line in cases.items():
        r = tstack.run("build", path, "--name", "x")
        assert r.exit_code == 1, (path, r.output)
        assert r.stderr.strip() == line
    assert tstack.svc.runtime.build_specs == []
    r = tstack.run("build", str(multi))  # no --name
    assert r.exit_code == 2


def test_template_ls_and_rm(tstack: TemplateStack, context: Path) -> None:
    for name in ("web", "api"):
        assert tstack.run("build", str(context), "--name", name).exit_code == 0
    r = tstack.run("template", "ls")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "TEMPLATE", "ID", "STATUS", "CPU", "MEMORY", "MB",
                                "CREATED"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert {"web", "api"} <= set(rows)
    assert rows["web"][2] == "ready"

    listed = json.loads(tstack.run("template", "ls", "-o", "json").stdout)
    assert json.loads(tstack.run("template", "ls", "--json").stdout) == listed
    assert tstack.run("template", "ls", "-o", "text").stdout == r.stdout
    by_alias = {t["aliases"][0]: t for t in listed if t["aliases"]}
    assert by_alias["web"]["templateID"] == rows["web"][1]
    assert by_alias["web"]["buildStatus"] == "ready"

    # in use by a sandbox: refused, with the API's reason
    r = tstack.run("start", "--template", "web")
    assert r.exit_code == 0, r.output
    sandbox_id = r.stdout.strip()
    r = tstack.run("template", "rm", "web")
    assert r.exit_code == 1
    assert r.stderr.startswith("aenv: API error 400: template 'web' is used by 1 sandbox")
    assert sandbox_id in r.stderr

    r = tstack.run("template", "rm", by_alias["api"]["templateID"])  # by id
    assert r.exit_code == 0, r.output
    names = [line.split()[0] for line in tstack.run("template", "ls").stdout.splitlines()]
    assert "api" not in names and "web" in names
    r = tstack.run("template", "rm", "api")
    assert r.exit_code == 4 and r.stderr.startswith("aenv: API error 404: ")
    assert r.stderr.endswith(" (see `aenv template ls`)\n")


# --- progress output: a terminal gets the live status line, a pipe plain lines ----------

def _aenv(tstack: TemplateStack, *args: str) -> list[str]:
    return [sys.executable, "-m", "host.cli", *tstack.argv(*args)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    return {**env, "TERM": "xterm-256color", "COLUMNS": "120"}


async def _slow_pull(spec: BuildSpec, log: Callable[..., None]) -> None:
    log("info", f"Pulling {spec.from_image}", "base")
    await asyncio.sleep(0.6)  # a few redraws


@pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")
@pytest.mark.parametrize("command", ["build", "pull"])
def test_progress_on_a_terminal(tstack: TemplateStack, context: Path,
                                monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    wrap_build(tstack, monkeypatch, _slow_pull)
    args = ["build", str(context)] if command == "build" else ["pull", "busybox"]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(_aenv(tstack, *args, "--name", "tty"),
                            cwd=REPO_ROOT, env=_env(), stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    buf = bytearray()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave fd is closed, aenv is done
                break
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=10) == 0, bytes(buf)
    text = bytes(buf).decode(errors="replace")
    assert ANSI.search(text)  # colours and the redrawn status line
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert re.search(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] \d+\.\ds  ", shown)  # spinner, elapsed time, step
    assert re.search(r"\d+\.\ds  Pulling ", shown)  # the pull is the step shown
    assert "Built tty: template" in text
    if command == "build":
        assert "Uploaded 'a.txt'" in text


def test_progress_through_a_pipe(tstack: TemplateStack, context: Path) -> None:
    proc = subprocess.run(_aenv(tstack, "build", str(context), "--name", "piped"),
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert not ANSI.search(proc.stdout + proc.stderr) and "\r" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in lines[:-1])
    assert "Uploaded 'a.txt'" in proc.stdout and lines[-1].startswith("Built piped: ")


# --- the SDK's exceptions as CliErrors (builder.sdk_errors) -----------------------------

@pytest.mark.parametrize(("exc", "message", "exit_code"), [
    (e2b.AuthenticationException(
        "401: Unauthorized, please check your credentials. - bad key"),
     "API error 401: bad key", 3),
    (e2b.AuthenticationException("API key is required"), "API key is required", 3),
    (e2b.BuildException("400: fromTemplate 'x': not found"),
     "API error 400: fromTemplate 'x': not found", 1),
    (e2b.BuildException("404: Template not found"), "API error 404: Template not found", 4),
    (e2b.BuildException("Command 'make' failed with exit code 2"),
     "build failed: Command 'make' failed with exit code 2", 1),
    (e2b.BuildException(""), "build failed: Build failed", 1),
    (e2b.FileUploadException("Failed to upload file: 413"),
     "build failed: Failed to upload file: 413", 1),
    (e2b.RateLimitException(  # type: ignore[no-untyped-call]
        "429: Rate limit exceeded, please try again later. - slow down"),
     "API error 429: slow down", 1),
    (e2b.ServiceBusyException("503: Service temporarily unavailable, please retry."),
     "API error 503: Service temporarily unavailable, please retry.", 1),
    (e2b.InvalidArgumentException("Both username and password are required"),
     "Both username and password are required", 1),
    (ValueError("No files found in /ctx/x"), "No files found in /ctx/x", 1),
    (httpx.ConnectError("[Errno 111] Connection refused"),
     "cannot reach the API at http://api (Connection refused)", 1),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else None)
def test_sdk_errors(exc: Exception, message: str, exit_code: int) -> None:
    with pytest.raises(CliError) as info, sdk_errors("http://api"):
        raise exc
    assert (info.value.message, info.value.exit_code) == (message, exit_code)
    assert info.value.__cause__ is exc
