"""`aenv terminal`: an interactive PTY over envd's `/terminal` WebSocket, via the proxy.

The local terminal is put in raw mode (restored on every exit path); stdin goes up as
binary frames, binary frames come down to stdout, SIGWINCH becomes a resize message, and
the remote `{"type":"exit","exitCode":N}` becomes our exit code. The socket is read by one
thread; the main thread multiplexes stdin and a self-pipe with select() (signal handlers
only write to the pipe, so nothing is sent from inside a handler).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from .envd import Envd
from .errors import ApiError, CliError, ConnectionFailed
from .rest import UNREACHABLE_HINTS

CLOSE_UNAUTHORIZED = 4401
CLOSE_BAD_REQUEST = 4400
_EOT = b"\x04"


def terminal_size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
        return size.columns or 80, size.lines or 24
    except OSError:
        return 80, 24


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Raw mode on a tty `fd` (no-op otherwise); the saved mode is restored on exit."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class _Session:
    def __init__(self, ws: ClientConnection, out_fd: int) -> None:
        self.ws = ws
        self.out_fd = out_fd
        self.exit_code: int | None = None
        self.close_code: int | None = None
        self.close_reason = ""
        self.wake_r, self.wake_w = os.pipe()
        self.done = threading.Event()

    def reader(self) -> None:
        try:
            for message in self.ws:
                if isinstance(message, bytes):
                    _write_all(self.out_fd, message)
                    continue
                with contextlib.suppress(ValueError, TypeError):
                    control: Any = json.loads(message)
                    if control.get("type") == "exit":
                        self.exit_code = int(control.get("exitCode", 0))
        except ConnectionClosed:
            pass
        except OSError:
            pass
        finally:
            with contextlib.suppress(Exception):
                self.close_code, self.close_reason = self.ws.close_code, self.ws.close_reason or ""
            self.done.set()
            with contextlib.suppress(OSError):
                os.write(self.wake_w, b"x")

    def close(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def run_terminal(envd: Envd, *, cmd: str | None = None, user: str | None = None,
                 cwd: str | None = None, in_fd: int | None = None,
                 out_fd: int | None = None) -> int:
    """Run the interactive session; returns the remote exit code."""
    in_fd = sys.stdin.fileno() if in_fd is None else in_fd
    out_fd = sys.stdout.fileno() if out_fd is None else out_fd
    is_tty = os.isatty(in_fd)
    cols, rows = terminal_size(in_fd if is_tty else out_fd)
    url = envd.terminal_url(cols=cols, rows=rows, cmd=cmd, user=user, cwd=cwd)
    headers = {k: v for k, v in envd.headers().items() if k != "User-Agent"}
    try:
        ws = connect(url, additional_headers=headers, open_timeout=30, max_size=None,
                     user_agent_header="aenv-cli/0.1")
    except InvalidStatus as exc:
        resp = exc.response
        body = bytes(resp.body or b"").decode("utf-8", "replace")
        message = body
        with contextlib.suppress(ValueError, AttributeError):
            message = str(json.loads(body).get("message") or body)
        raise ApiError(resp.status_code, message.strip() or resp.reason_phrase,
                       what="proxy") from exc
    except InvalidHandshake as exc:
        raise ConnectionFailed(f"terminal handshake failed: {exc}") from exc
    except (OSError, TimeoutError) as exc:
        raise ConnectionFailed(f"cannot reach the sandbox proxy at {envd.sandbox_url} ({exc})",
                               hint=UNREACHABLE_HINTS["sandbox proxy"]) from exc

    session = _Session(ws, out_fd)
    reader = threading.Thread(target=session.reader, name="aenv-terminal-reader", daemon=True)
    winch_pending = False

    def on_winch(signum: int, frame: object) -> None:
        nonlocal winch_pending
        winch_pending = True
        with contextlib.suppress(OSError):
            os.write(session.wake_w, b"w")

    old_winch = signal.signal(signal.SIGWINCH, on_winch) if is_tty else None
    stdin_open = True
    try:
        with raw_mode(in_fd):
            reader.start()
            while not session.done.is_set():
                fds = [session.wake_r] + ([in_fd] if stdin_open else [])
                try:
                    ready, _, _ = select.select(fds, [], [])
                except InterruptedError:
                    continue
                if session.wake_r in ready:
                    os.read(session.wake_r, 512)
                    if winch_pending:
                        winch_pending = False
                        c, r = terminal_size(in_fd)
                        _send(ws, json.dumps({"type": "resize", "cols": c, "rows": r}))
                if stdin_open and in_fd in ready:
                    data = os.read(in_fd, 65536)
                    if not data:
                        # Not a tty and at EOF: an EOT makes the remote PTY see end of input.
                        stdin_open = False
                        data = _EOT
                    _send(ws, data)
    finally:
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        with contextlib.suppress(Exception):
            ws.close()
        reader.join(timeout=5)
        session.close()

    if session.exit_code is not None:
        return session.exit_code
    if session.close_code == CLOSE_UNAUTHORIZED:
        raise ApiError(401, f"envd refused the terminal: {session.close_reason or 'unauthorized'}",
                       what="envd")
    if session.close_code == CLOSE_BAD_REQUEST:
        raise ApiError(400, session.close_reason or "bad terminal request", what="envd")
    raise CliError(f"terminal closed without an exit status (close code {session.close_code}"
                   f"{': ' + session.close_reason if session.close_reason else ''})")


def _send(ws: ClientConnection, data: str | bytes) -> None:
    with contextlib.suppress(ConnectionClosed, OSError):
        ws.send(data)
