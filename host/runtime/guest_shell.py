"""`GuestShell`: commands and file uploads in a build VM through its envd (the E2B envd
protocol: Connect `process.Process/Start` streams and `POST /files`), as root or any user.

Used by template builds, where the host drives a freshly booted VM that has no access
token yet. One httpx client per build; the caller closes it. The guest runs the user's
image and may be hostile: answers are read through host/guestio.py (one Connect message,
one output line, an answer body: each at most its limit), and one past a limit fails the
command with a GuestCommandError that says so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

from host import guestio
from host.connect_envelope import END_STREAM, envelope

OnOutput = Callable[[str, str], None]  # (stream: stdout|stderr, line)


class GuestCommandError(Exception):
    """envd could not run a command (not: the command failed; that is its exit code)."""


# The user's commands (RUN steps, start and ready commands) run as E2B runs them, through
# `/bin/bash -l -c` (so bash builtins such as `exec -a` work and the login profile is read),
# and through `/bin/sh -c` in an image without bash. Chosen in the guest by this wrapper
# rather than probed once: a RUN step may install bash for the steps after it.
_BASH_OR_SH = 'if [ -x /bin/bash ]; then exec /bin/bash -l -c "$1"; fi; exec /bin/sh -c "$1"'
# E2B appends these to a PATH the template sets, so that a broken PATH still finds the
# usual tools.
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class GuestShell:
    def __init__(self, host: str, port: int, *, timeout_s: float = 30.0) -> None:
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        self.base = f"http://{host}:{port}"
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _headers(user: str, timeout_s: float | None) -> dict[str, str]:
        h = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
             "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}
        if timeout_s is not None:
            h["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
        return h

    @staticmethod
    def _request(cmd: str | list[str], env: dict[str, str], cwd: str | None, tag: str | None,
                 login: bool) -> dict[str, Any]:
        """A Start request: `login` for the user's commands (bash -l, see _BASH_OR_SH),
        plain `/bin/sh -c` for our own scripts; a list: that program, no shell."""
        if isinstance(cmd, list):
            program, argv = cmd[0], cmd[1:]
        elif login:
            if "PATH" in env:
                env = {**env, "PATH": f"{env['PATH']}:{_STANDARD_PATH}"}
            program, argv = "/bin/sh", ["-c", _BASH_OR_SH, "sh", cmd]
        else:
            program, argv = "/bin/sh", ["-c", cmd]
        process: dict[str, Any] = {"cmd": program, "args": argv, "envs": env}
        if cwd:
            process["cwd"] = cwd
        req: dict[str, Any] = {"process": process, "stdin": False}
        if tag:
            req["tag"] = tag
        return req

    async def run(self, cmd: str | list[str], *, user: str = "root",
                  env: dict[str, str] | None = None,
                  cwd: str | None = None, timeout_s: float = 3600.0,
                  on_output: OnOutput | None = None, login: bool = False) -> int:
        """Run `cmd` (`/bin/sh -c`; with `login`, the user's command: see _BASH_OR_SH) and
        wait for it; returns its exit code. Output lines go to `on_output` as they
        arrive. envd refusing it (an unknown user, ...) is a GuestCommandError worded as
        E2B's builder words it: `command failed: <connect code>: <message>`."""
        body = envelope(self._request(cmd, env or {}, cwd, None, login))
        # one bounded line splitter per stream: a guest printing 1 GiB without a newline
        # holds MAX_LINE_BYTES here
        lines = {"stdout": guestio.Lines(), "stderr": guestio.Lines()}

        def emit(stream: str, done: list[bytes]) -> None:
            if on_output is not None:
                for line in done:
                    on_output(stream, line.decode(errors="replace"))

        end: dict[str, Any] | None = None
        try:
            async with self._stream(body, user, timeout_s,
                                    httpx.Timeout(30.0, read=timeout_s + 30.0)) as messages:
                async for flags, msg in messages:
                    if flags & END_STREAM:
                        if msg.get("error"):
                            raise GuestCommandError(f"command failed: "
                                                    f"{_connect_error(msg['error'])}")
                        break
                    event = _event(msg)
                    if "data" in event:
                        for stream, data in _output(event["data"]):
                            emit(stream, lines[stream].feed(data))
                    elif "end" in event and isinstance(event["end"], dict):
                        end = event["end"]
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"running a command through envd failed: {exc}") from exc
        except guestio.GuestAnswerError as exc:
            raise GuestCommandError(str(exc)) from exc
        for stream, splitter in lines.items():
            emit(stream, splitter.close())
        if end is None:
            raise GuestCommandError("the command's stream ended without an end event")
        if end.get("error") and not end.get("exited", True):
            raise GuestCommandError(f"envd could not run the command: {end['error']}")
        try:
            return int(end.get("exitCode", end.get("exit_code", 0)) or 0)
        except (TypeError, ValueError):
            raise GuestCommandError(f"envd sent an exit code that is not a number: "
                                    f"{str(end)[:200]}") from None

    async def start(self, cmd: str, *, user: str, env: dict[str, str], cwd: str | None,
                    tag: str) -> int:
        """Start the user's `cmd` in the background (it keeps running after we disconnect:
        envd processes outlive their clients); returns its pid."""
        body = envelope(self._request(cmd, env, cwd, tag, True))
        try:
            async with self._stream(body, user, None, httpx.USE_CLIENT_DEFAULT) as messages:
                async for flags, msg in messages:
                    if flags & END_STREAM:
                        raise GuestCommandError(f"the start command did not start: "
                                                f"{str(msg)[:300]}")
                    start = _event(msg).get("start")
                    if isinstance(start, dict):
                        return int(start.get("pid", 0))
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"starting a command through envd failed: {exc}") from exc
        except guestio.GuestAnswerError as exc:
            raise GuestCommandError(str(exc)) from exc
        except (TypeError, ValueError) as exc:  # a pid that is not a number
            raise GuestCommandError(f"envd sent a malformed start event: {exc}") from exc
        raise GuestCommandError("the start command's stream ended before it started")

    @contextlib.asynccontextmanager
    async def _stream(self, body: bytes, user: str, timeout_s: float | None,
                      timeout: Any) -> AsyncIterator[AsyncIterator[tuple[int, dict[str, Any]]]]:
        """The messages of a `process.Process/Start` stream, each at most
        MAX_MESSAGE_BYTES; a non-200 answer is a GuestCommandError."""
        async with guestio.stream(self._http, "POST", f"{self.base}{_START}", content=body,
                                  headers=self._headers(user, timeout_s),
                                  timeout=timeout) as resp:
            if resp.status_code != 200:
                answer = await guestio.read_body(resp, limit=guestio.MAX_ANSWER_BYTES,
                                                 what=_START)
                raise GuestCommandError(f"envd answered {resp.status_code}: {answer[:300]!r}")
            # aclosing: a caller that returns mid-stream (start) ends the reader here,
            # before the response closes, not whenever the loop finalizes it
            async with contextlib.aclosing(guestio.aiter_messages(resp, what=_START)) as it:
                yield it

    async def init_clock(self) -> None:
        """`POST /init` with the host's clock and fresh entropy (a VM restored from a
        snapshot has the snapshot's of both)."""
        try:
            resp = await guestio.request(self._http, "POST", f"{self.base}/init",
                                         limit=guestio.MAX_ANSWER_BYTES, what="/init",
                                         json=guestio.clock_and_entropy())
        except (httpx.HTTPError, guestio.GuestAnswerError) as exc:
            raise GuestCommandError(f"envd /init failed: {exc}") from exc
        if resp.status_code >= 300:
            raise GuestCommandError(f"envd /init answered {resp.status_code}")

    async def upload(self, local: Path, guest_path: str, *, user: str = "root") -> None:
        """Write `local` to `guest_path` (octet-stream upload; envd writes it as `user`)."""
        async def chunks() -> Any:
            with local.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk

        await self._files("POST", f"uploading {local.name}", guest_path, user,
                          limit=guestio.MAX_ANSWER_BYTES, content=chunks(), timeout=600.0,
                          headers={"Content-Type": "application/octet-stream",
                                   "Content-Length": str(local.stat().st_size)})

    async def read_file(self, guest_path: str, *, user: str = "root",
                        limit: int = 64 << 10) -> bytes | None:
        """A small guest file's bytes (envd's GET /files: no process, no shell needed),
        None when it does not exist; more than `limit` bytes is an error."""
        resp = await self._files("GET", f"reading {guest_path}", guest_path, user,
                                 limit=limit, missing_ok=True)
        return None if resp is None else resp.content

    async def _files(self, method: str, doing: str, guest_path: str, user: str, *,
                     limit: int, missing_ok: bool = False,
                     **kwargs: Any) -> guestio.Answer | None:
        """envd's /files for `guest_path` as `user`, its failures as GuestCommandError
        saying what was being done; None for a 404 when `missing_ok`."""
        try:
            resp = await guestio.request(
                self._http, method, f"{self.base}/files", limit=limit, what="/files",
                params={"path": guest_path, "username": user}, **kwargs)
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"{doing} failed: {exc}") from exc
        except guestio.GuestAnswerError as exc:
            raise GuestCommandError(f"{doing}: {exc}") from exc
        if missing_ok and resp.status_code == 404:
            return None
        if resp.status_code >= 300:
            raise GuestCommandError(f"{doing}: envd answered "
                                    f"{resp.status_code}: {resp.text[:200]}")
        return resp

    async def wait_until(self, cmd: str, *, user: str, env: dict[str, str],
                         cwd: str | None, timeout_s: float, interval_s: float = 0.5,
                         on_fail: Callable[[int], None] | None = None) -> bool:
        """Run the user's `cmd` until it exits 0 (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(GuestCommandError):
                code = await self.run(cmd, user=user, env=env, cwd=cwd, login=True,
                                      timeout_s=max(5.0, min(60.0, timeout_s)))
                if code == 0:
                    return True
                if on_fail is not None:
                    on_fail(code)
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval_s)


_START = "/process.Process/Start"


def _connect_error(error: Any) -> str:
    """A Connect end-of-stream error as Go's connect prints one: `<code>: <message>`."""
    if isinstance(error, dict):
        code, message = error.get("code", "unknown"), error.get("message", "")
        return f"{code}: {message}" if message else str(code)
    return str(error)[:300]


def _event(msg: dict[str, Any]) -> dict[str, Any]:
    event = msg.get("event")
    return event if isinstance(event, dict) else {}


def _output(data: Any) -> list[tuple[str, bytes]]:
    """(stream, bytes) of a data event; a malformed one is a GuestCommandError."""
    if not isinstance(data, dict):
        raise GuestCommandError(f"envd sent a malformed data event: {str(data)[:200]}")
    try:
        return [(stream, base64.b64decode(data[stream]))
                for stream in ("stdout", "stderr") if stream in data]
    except (TypeError, ValueError) as exc:
        raise GuestCommandError(f"envd sent output that is not base64: {exc}") from exc
