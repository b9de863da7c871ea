"""envd through the sandbox proxy: commands (Connect streaming) and files.

Every request goes to the proxy (`--sandbox-url`) with `E2b-Sandbox-Id` and
`E2b-Sandbox-Port: 49983`, and carries the sandbox's `envdAccessToken` when it has one.

The Connect protocol for a server-streaming call is small enough to frame by hand
(host/connect_envelope.py): the request body is one envelope (flags byte, 4-byte big-endian length, JSON message), the
response is a sequence of envelopes, the last one flagged 0x02 with `{"error": ...}` when
the call failed. This keeps the CLI free of the e2b SDK.
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlencode

import httpx

from host.connect_envelope import COMPRESSED, END_STREAM, EnvelopeError, envelope, messages

from .errors import ApiError, CliError
from .rest import USER_AGENT, raise_for_status, transport_errors

ENVD_PORT = 49983
CHUNK = 1024 * 1024


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    status: str
    exited: bool = True
    error: str | None = None


class TransferObserver(Protocol):
    """Told how a file transfer goes (progress.TransferProgress draws it)."""

    def start(self, total: int | None) -> None:
        """The transfer begins: `total` bytes (None: unknown)."""

    def advance(self, n: int) -> None:
        """`n` more bytes went through."""


def sent_chunks(f: IO[bytes], observer: TransferObserver | None) -> Iterator[bytes]:
    """`f`'s blocks for a streamed upload, each counted once it went out (httpx asks for
    the next one then)."""
    while block := f.read(CHUNK):
        yield block
        if observer is not None:
            observer.advance(len(block))


def received(resp: httpx.Response, out: IO[bytes], observer: TransferObserver | None) -> int:
    """Copy a streamed answer's body into `out`, counted; the bytes written."""
    if observer is not None:
        observer.start(_body_size(resp))
    written = 0
    for block in resp.iter_bytes(CHUNK):
        out.write(block)
        written += len(block)
        if observer is not None:
            observer.advance(len(block))
    return written


@contextlib.contextmanager
def whole_file(local: Path) -> Iterator[IO[bytes]]:
    """A file to write `local` through: a temp file beside it, renamed to `local` when
    the block ends, removed if it fails (a failed download leaves no partial file)."""
    tmp = local.with_name(f".{local.name}.aenv-part")
    try:
        with tmp.open("wb") as out:
            yield out
        tmp.replace(local)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CliError(f"cannot write {local}: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def shell_command(argv: tuple[str, ...] | list[str]) -> str:
    """One argument is a shell command line; several are quoted into one."""
    import shlex
    return argv[0] if len(argv) == 1 else shlex.join(argv)


class Envd:
    """envd of one sandbox, reached through the proxy at `sandbox_url`."""

    def __init__(self, sandbox_url: str, sandbox_id: str, access_token: str | None) -> None:
        self.sandbox_url = sandbox_url.rstrip("/")
        self.sandbox_id = sandbox_id
        self.access_token = access_token
        self._http = httpx.Client(base_url=self.sandbox_url, headers=self.headers(),
                                  timeout=httpx.Timeout(60.0, connect=10.0, read=None))

    def close(self) -> None:
        self._http.close()

    def headers(self) -> dict[str, str]:
        h = {"E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT),
             "User-Agent": USER_AGENT}
        if self.access_token:
            h["X-Access-Token"] = self.access_token
        return h

    @staticmethod
    def _user_header(user: str | None) -> dict[str, str]:
        if not user:
            return {}
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}

    # --- commands -----------------------------------------------------------------------

    def exec(self, command: str, *, user: str | None = None, cwd: str | None = None,
             envs: dict[str, str] | None = None, stdout: IO[bytes], stderr: IO[bytes],
             on_start: Callable[[int], None] | None = None) -> ExecResult:
        """Run `bash -l -c command`, streaming its output live; returns its exit status."""
        process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", command],
                                   "envs": dict(envs or {})}
        if cwd:
            process["cwd"] = cwd
        message = {"process": process, "stdin": False}
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                   "Keepalive-Ping-Interval": "30", **self._user_header(user)}
        body = envelope(message)
        with transport_errors(self.sandbox_url, "sandbox proxy"), self._http.stream(
                "POST", "/process.Process/Start", content=body, headers=headers) as resp:
            raise_for_status(resp, what="envd")
            for msg in _envelopes(resp.iter_bytes()):
                event = msg.get("event") or {}
                if "start" in event and on_start is not None:
                    on_start(int(event["start"].get("pid", 0)))
                elif "data" in event:
                    data = event["data"]
                    for key, sink in (("stdout", stdout), ("stderr", stderr), ("pty", stdout)):
                        if key in data:
                            sink.write(base64.b64decode(data[key]))
                            sink.flush()
                elif "end" in event:
                    end = event["end"]
                    return ExecResult(int(end.get("exitCode", 0)), str(end.get("status", "")),
                                      bool(end.get("exited", False)), end.get("error"))
        raise CliError("envd closed the command stream without an exit status")

    def kill_process(self, pid: int) -> None:
        """Best effort SIGKILL of a process started by `exec` (unary Connect, JSON). Sent
        on a client of its own: after a Ctrl-C cut the streaming request anywhere (even
        inside the connection pool, which may stay locked), this one must not wait on it."""
        with transport_errors(self.sandbox_url, "sandbox proxy"), \
                httpx.Client(base_url=self.sandbox_url, headers=self.headers()) as http:
            http.post("/process.Process/SendSignal",
                      json={"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"},
                      headers={"Connect-Protocol-Version": "1"}, timeout=5.0)

    # --- files --------------------------------------------------------------------------

    def upload(self, local: Path, remote: str, *, user: str | None = None,
               observer: TransferObserver | None = None) -> int:
        """Stream `local` to `remote` (application/octet-stream); returns bytes sent."""
        try:
            f = local.open("rb")
        except OSError as exc:
            raise CliError(f"cannot read {local}: {exc.strerror or exc}") from exc
        size = os.fstat(f.fileno()).st_size
        if observer is not None:
            observer.start(size)
        params = {"path": remote, **({"username": user} if user else {})}
        with f, transport_errors(self.sandbox_url, "sandbox proxy"):
            resp = self._http.post("/files", params=params, content=sent_chunks(f, observer),
                                   headers={"Content-Type": "application/octet-stream",
                                            "Content-Length": str(size)})
        raise_for_status(resp, what="envd")
        return size

    def download(self, remote: str, local: Path, *, user: str | None = None,
                 observer: TransferObserver | None = None) -> int:
        """Stream `remote` into `local` (written to a temp file, renamed at the end)."""
        params = {"path": remote, **({"username": user} if user else {})}
        with transport_errors(self.sandbox_url, "sandbox proxy"), self._http.stream(
                "GET", "/files", params=params) as resp:
            raise_for_status(resp, what="envd")
            with whole_file(local) as out:
                return received(resp, out, observer)

    # --- terminal -----------------------------------------------------------------------

    def terminal_url(self, *, cols: int, rows: int, cmd: str | None = None,
                     user: str | None = None, cwd: str | None = None) -> str:
        params: dict[str, str] = {"cols": str(cols), "rows": str(rows)}
        for key, value in (("cmd", cmd), ("user", user), ("cwd", cwd)):
            if value:
                params[key] = value
        base = self.sandbox_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return f"{base}/terminal?{urlencode(params)}"


def _body_size(resp: httpx.Response) -> int | None:
    """The size of the decoded body, when the answer says (not for an encoded one)."""
    length = resp.headers.get("content-length")
    if length is None or not length.isdigit() or resp.headers.get("content-encoding"):
        return None
    return int(length)


def _envelopes(stream: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """Decode Connect envelopes; raise ApiError for an end-of-stream error."""
    try:
        # envd streams output in 64 KiB chunks: a larger message is not envd's
        for flags, msg in messages(stream, max_bytes=_MAX_MESSAGE_BYTES):
            if flags & COMPRESSED:
                raise CliError("envd sent a compressed message the CLI did not ask for")
            if flags & END_STREAM:
                err = msg.get("error")
                if err:
                    raise ApiError(_connect_status(err.get("code", "")),
                                   f"{err.get('code', 'unknown')}: {err.get('message', '')}",
                                   what="envd")
                return
            yield msg
    except EnvelopeError as exc:
        raise CliError(f"envd stream: {exc}") from exc


_MAX_MESSAGE_BYTES = 16 << 20


# Connect error code -> the HTTP status it corresponds to (connectrpc.com/docs/protocol)
_CONNECT_HTTP = {"invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
                 "not_found": 404, "already_exists": 409, "failed_precondition": 412,
                 "unavailable": 503, "deadline_exceeded": 504}


def _connect_status(code: str) -> int:
    return _CONNECT_HTTP.get(code, 500)
