"""`/terminal`: an interactive PTY over a WebSocket (an aenv extension, not in E2B's API).

Protocol:
- connect to `ws://<envd>/terminal?cols=80&rows=24[&cmd=...][&user=...][&cwd=...][&tag=...]`;
  `cmd` is a shell command run with `bash -l -c`; without it, the user's login shell
  runs interactively. Auth: `X-Access-Token` header or `access_token` query parameter
  once /init set a token; otherwise the socket is accepted and closed with 4401.
- binary frames carry raw bytes both ways (client → PTY input, PTY output → client);
- text frames from the client are JSON control messages: `{"type":"resize","cols":C,"rows":R}`
  or `{"type":"input","data":"<text>"}`; anything else closes the socket with 1003;
- when the process ends the server sends `{"type":"exit","exitCode":N,"status":"..."}`
  as a text frame and closes with 1000. A client that disconnects kills the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from typing import Any

from connectrpc.errors import ConnectError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from ...auth import AuthError, basic_auth_user, token_matches
from ...state import Defaults
from ...users import UnknownUserError, User
from .fanout import Subscription
from .launch import process_env, resolve_cwd
from .proc import ExitStatus, Output, Proc, SpawnSpec
from .table import ProcessTable

CLOSE_UNAUTHORIZED = 4401
CLOSE_BAD_REQUEST = 4400
CLOSE_UNSUPPORTED = 1003


class TerminalRequestError(Exception):
    """The query string does not describe a startable terminal."""


def _int_param(ws: WebSocket, name: str, default: int) -> int:
    raw = ws.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise TerminalRequestError(f"{name} must be an integer") from None
    if not 0 < value < 65536:
        raise TerminalRequestError(f"{name} out of range")
    return value


def terminal_spec(ws: WebSocket, defaults: Defaults) -> SpawnSpec:
    try:
        name = (ws.query_params.get("user")
                or basic_auth_user(ws.headers.get("authorization")) or defaults.user)
        user = User.lookup(name)
    except (UnknownUserError, AuthError) as exc:
        raise TerminalRequestError(str(exc)) from None
    cmd = ws.query_params.get("cmd")
    argv = ["/bin/bash", "-l", "-c", cmd] if cmd else [user.shell or "/bin/bash", "-i", "-l"]
    env = process_env(user, defaults, {"TERM": "xterm-256color", "LANG": "C.UTF-8",
                                       "LC_ALL": "C.UTF-8"})
    try:
        cwd = resolve_cwd(ws.query_params.get("cwd"), user, defaults)
    except ConnectError as exc:
        raise TerminalRequestError(exc.message) from None
    size = (_int_param(ws, "cols", 80), _int_param(ws, "rows", 24))
    return SpawnSpec(argv=argv, env=env, cwd=cwd, user=user, pty_size=size,
                     tag=ws.query_params.get("tag") or None)


async def _pump_output(ws: WebSocket, sub: Subscription[Output, ExitStatus]) -> None:
    async for item in sub:
        if isinstance(item, ExitStatus):
            await ws.send_text(json.dumps({"type": "exit", "exitCode": item.exit_code,
                                           "status": item.status}))
            await ws.close(code=1000)
            return
        await ws.send_bytes(item[1])


async def _pump_input(ws: WebSocket, proc: Proc) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            await proc.write_input(message["bytes"])
            continue
        try:
            control: Any = json.loads(message.get("text") or "")
            kind = control["type"]
            if kind == "resize":
                proc.resize(int(control["cols"]), int(control["rows"]))
            elif kind == "input":
                await proc.write_input(str(control["data"]).encode())
            else:
                raise ValueError(f"unknown control message type {kind!r}")
        except (ValueError, KeyError, TypeError) as exc:
            await ws.close(code=CLOSE_UNSUPPORTED, reason=str(exc)[:120])
            return


def terminal_route(table: ProcessTable, defaults: Defaults) -> WebSocketRoute:
    """The `/terminal` WebSocket route; its processes live in `table` (the one the
    process.Process service uses, so List/SendSignal see terminals too)."""
    async def terminal(ws: WebSocket) -> None:
        presented = ws.headers.get("x-access-token") or ws.query_params.get("access_token")
        await ws.accept()
        if not token_matches(defaults, presented):
            await ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized")
            return
        try:
            spec = terminal_spec(ws, defaults)
            proc, sub = await table.spawn(spec)
        except (TerminalRequestError, OSError) as exc:
            await ws.close(code=CLOSE_BAD_REQUEST, reason=str(exc)[:120])
            return
        tasks = [asyncio.create_task(_pump_output(ws, sub)),
                 asyncio.create_task(_pump_input(ws, proc))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                # The socket or the process may already be gone; nothing left to report.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            sub.close()
            if proc.running:  # the client left: a terminal does not outlive its socket
                proc.signal(signal.SIGHUP)
                proc.signal(signal.SIGKILL)
            with contextlib.suppress(RuntimeError):
                await ws.close(code=1000)

    return WebSocketRoute("/terminal", terminal)


__all__ = ["TerminalRequestError", "terminal_route", "terminal_spec"]
