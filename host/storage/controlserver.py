"""The block server's control socket: one JSON request per connection (`{"op", "args"}`,
a line), one JSON reply (`{"ok": true, "result"}` or control.py's error reply). Every failure
becomes an error reply; the server stays up. The client side is control.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from .control import StackInfo, error_reply
from .errors import StorageError

log = logging.getLogger(__name__)
MAX_REQUEST = 1 << 24  # a create naming many layers fits; a longer line is refused
Op = Callable[..., Awaitable[Any]]


class ControlServer:
    """Serves `ops` (an op's `args` are its keyword arguments) and `instant` (answered
    without arguments: ping, stats) on the unix socket `path`."""

    def __init__(self, path: Path, ops: Mapping[str, Op],
                 instant: Mapping[str, Callable[[], Any]]) -> None:
        self.path = path
        self._ops = dict(ops)
        self._instant = dict(instant)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._handle, str(self.path),
                                                       limit=MAX_REQUEST)

    async def aclose(self) -> None:
        if self._server is None:
            return
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            if not line:
                return
            reply = await self.dispatch(line)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def dispatch(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            op = req["op"]
            kwargs = dict(req.get("args") or {})
            if op in self._instant:
                out = self._instant[op]()
            elif (fn := self._ops.get(op)) is not None:
                out = await fn(**kwargs)
            else:
                raise ValueError(f"unknown op {op!r}")
            if isinstance(out, StackInfo):
                out = out.to_dict()
            elif isinstance(out, list) and all(isinstance(i, StackInfo) for i in out):
                out = [i.to_dict() for i in out]
            return {"ok": True, "result": out}
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every failure becomes an error reply; the server stays up
            if not isinstance(exc, (StorageError, ValueError, KeyError, TypeError)):
                log.exception("control request failed")
            return error_reply(exc)
