"""`GuestShell`: commands and file uploads in a build VM through its envd (the E2B envd
protocol: Connect `process.Process/Start` streams and `POST /files`), as root or any user.

Used by template builds, where the host drives a freshly booted VM that has no access
token yet. One httpx client per build; the caller closes it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from host.connect_envelope import END_STREAM, EnvelopeError, envelope, messages

OnOutput = Callable[[str, str], None]  # (stream: stdout|stderr, line)


class GuestCommandError(Exception):
    """envd could not run a command (not: the command failed; that is its exit code)."""


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
    def _request(cmd: str, env: dict[str, str], cwd: str | None, tag: str | None
                 ) -> dict[str, Any]:
        process: dict[str, Any] = {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": env}
        if cwd:
            process["cwd"] = cwd
        req: dict[str, Any] = {"process": process, "stdin": False}
        if tag:
            req["tag"] = tag
        return req

    async def run(self, cmd: str, *, user: str = "root", env: dict[str, str] | None = None,
                  cwd: str | None = None, timeout_s: float = 3600.0,
                  on_output: OnOutput | None = None) -> int:
        """Run `/bin/sh -c cmd` and wait for it; returns its exit code. Output lines go
        to `on_output` as they arrive."""
        body = envelope(self._request(cmd, env or {}, cwd, None))
        tails = {"stdout": b"", "stderr": b""}

        def emit(stream: str, data: bytes, *, final: bool = False) -> None:
            buf = tails[stream] + data
            *lines, tails[stream] = buf.split(b"\n")
            if final and tails[stream]:
                lines.append(tails[stream])
                tails[stream] = b""
            if on_output is not None:
                for line in lines:
                    on_output(stream, line.decode(errors="replace"))

        end: dict[str, Any] | None = None
        try:
            async with self._http.stream(
                    "POST", f"{self.base}/process.Process/Start", content=body,
                    headers=self._headers(user, timeout_s),
                    timeout=httpx.Timeout(30.0, read=timeout_s + 30.0)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300]
                    raise GuestCommandError(f"envd answered {resp.status_code}: {text!r}")
                async for flags, msg in _aiter_messages(resp.aiter_bytes()):
                    if flags & END_STREAM:
                        if msg.get("error"):
                            raise GuestCommandError(f"envd: {msg['error']}")
                        break
                    event = msg.get("event") or {}
                    if "data" in event:
                        for stream in ("stdout", "stderr"):
                            if stream in event["data"]:
                                emit(stream, base64.b64decode(event["data"][stream]))
                    elif "end" in event:
                        end = event["end"]
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"running a command through envd failed: {exc}") from exc
        for stream in ("stdout", "stderr"):
            emit(stream, b"", final=True)
        if end is None:
            raise GuestCommandError("the command's stream ended without an end event")
        if end.get("error") and not end.get("exited", True):
            raise GuestCommandError(f"envd could not run the command: {end['error']}")
        return int(end.get("exitCode", end.get("exit_code", 0)) or 0)

    async def start(self, cmd: str, *, user: str, env: dict[str, str], cwd: str | None,
                    tag: str) -> int:
        """Start `cmd` in the background (it keeps running after we disconnect: envd
        processes outlive their clients); returns its pid."""
        body = envelope(self._request(cmd, env, cwd, tag))
        try:
            async with self._http.stream(
                    "POST", f"{self.base}/process.Process/Start", content=body,
                    headers=self._headers(user, None)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300]
                    raise GuestCommandError(f"envd answered {resp.status_code}: {text!r}")
                async for flags, msg in _aiter_messages(resp.aiter_bytes()):
                    if flags & END_STREAM:
                        raise GuestCommandError(f"the start command did not start: {msg}")
                    start = (msg.get("event") or {}).get("start")
                    if start is not None:
                        return int(start.get("pid", 0))
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"starting a command through envd failed: {exc}") from exc
        raise GuestCommandError("the start command's stream ended before it started")

    async def upload(self, local: Path, guest_path: str, *, user: str = "root") -> None:
        """Write `local` to `guest_path` (octet-stream upload; envd writes it as `user`)."""
        async def chunks() -> Any:
            with local.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    yield chunk

        try:
            resp = await self._http.post(
                f"{self.base}/files", params={"path": guest_path, "username": user},
                content=chunks(), timeout=600.0,
                headers={"Content-Type": "application/octet-stream",
                         "Content-Length": str(local.stat().st_size)})
        except httpx.HTTPError as exc:
            raise GuestCommandError(f"uploading {local.name} failed: {exc}") from exc
        if resp.status_code >= 300:
            raise GuestCommandError(f"uploading {local.name}: envd answered "
                                    f"{resp.status_code}: {resp.text[:200]}")

    async def wait_until(self, cmd: str, *, user: str, env: dict[str, str],
                         cwd: str | None, timeout_s: float, interval_s: float = 0.5,
                         on_fail: Callable[[int], None] | None = None) -> bool:
        """Run `cmd` until it exits 0 (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(GuestCommandError):
                code = await self.run(cmd, user=user, env=env, cwd=cwd,
                                      timeout_s=max(5.0, min(60.0, timeout_s)))
                if code == 0:
                    return True
                if on_fail is not None:
                    on_fail(code)
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(interval_s)


async def _aiter_messages(chunks: Any) -> Any:
    """Connect envelopes from an async byte stream (host.connect_envelope.messages over
    what has arrived so far)."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        complete = b""
        # hand whole envelopes to the decoder, keep a cut one for the next chunk
        while len(buf) >= 5:
            length = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + length:
                break
            complete, buf = complete + buf[:5 + length], buf[5 + length:]
        if complete:
            try:
                for item in messages([complete]):
                    yield item
            except EnvelopeError as exc:
                raise GuestCommandError(f"envd sent a malformed stream: {exc}") from exc
    if buf:
        raise GuestCommandError("envd's stream ended in the middle of a message")
