"""`GuestServer`: one sandbox's volume mounts, served to its guest (envd/volumes).

It listens on a socket the runtime made inside the sandbox's network namespace (at the
guest's gateway address): only that guest can connect, so the connection itself says
which sandbox asks, and the sandbox's mounts say which volumes it may name. Everything
the guest sends is bounded (wire.py sizes, `MAX_CONNECTIONS`); a request it names a
volume it has not mounted is answered EACCES. Operations run off the event loop.

Retried mutations (the guest resends after its connection broke, e.g. across a pause)
are answered from a duplicate-request cache shared by the node's servers, keyed by
sandbox and request id, instead of being done twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envd.volumes import wire  # the protocol's one definition, shared with the guest side

from .errors import InvalidVolume
from .posix import VolumeOps

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64        # the guest's FUSE threads; more is a guest misbehaving
REPLAY_ENTRIES = 4096


class ReplayCache:
    """Answers of recent mutations, by (sandbox id, request id); bounded, oldest out."""

    def __init__(self, size: int = REPLAY_ENTRIES) -> None:
        self.size = size
        self._done: OrderedDict[tuple[str, int], bytes] = OrderedDict()

    def get(self, key: tuple[str, int]) -> bytes | None:
        return self._done.get(key)

    def put(self, key: tuple[str, int], answer: bytes) -> None:
        self._done[key] = answer
        while len(self._done) > self.size:
            self._done.popitem(last=False)


class GuestServer:
    """Serves `mounts` (volume name -> its data directory) of `sandbox_id`."""

    def __init__(self, sandbox_id: str, mounts: Mapping[str, Path], *,
                 replays: ReplayCache, min_free_bytes: int = 0) -> None:
        self.sandbox_id = sandbox_id
        self.mounts = dict(mounts)
        self.replays = replays
        self.min_free_bytes = min_free_bytes
        self._ops: dict[str, VolumeOps] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self, sock: socket.socket) -> None:
        """Serve on `sock` (listening; owned by the server from here on)."""
        self._server = await asyncio.start_server(self._serve, sock=sock)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(BaseException):
                await task
        for ops in self._ops.values():
            ops.close()
        self._ops.clear()

    def _volume(self, name: Any) -> VolumeOps:
        directory = self.mounts.get(name) if isinstance(name, str) else None
        if directory is None:
            raise OSError(errno.EACCES, f"volume {name!r} is not mounted in this sandbox")
        ops = self._ops.get(name)
        if ops is None:
            ops = self._ops[name] = VolumeOps(directory, min_free_bytes=self.min_free_bytes)
        if ops.gone():
            raise OSError(errno.ESTALE, f"volume {name!r} was destroyed")
        return ops

    def _answer(self, req: dict[str, Any], payload: bytes) -> bytes:
        """One request, done (blocking): its encoded answer."""
        try:
            result, data = self._volume(req.get("vol")).call(req, payload)
            return wire.encode({"errno": 0, **result}, data)
        except InvalidVolume:
            return wire.encode({"errno": errno.EINVAL})
        except OSError as exc:
            return wire.encode({"errno": exc.errno or errno.EIO})
        except Exception:  # a guest's request never ends the server
            log.exception("sandbox %s: volume request %s failed", self.sandbox_id,
                          req.get("op"))
            return wire.encode({"errno": errno.EIO})

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._conns.add(task)
        try:
            while True:
                head_len, body_len = wire.sizes(await reader.readexactly(wire.PREFIX_SIZE))
                req = wire.decode_header(await reader.readexactly(head_len))
                payload = await reader.readexactly(body_len) if body_len else b""
                rid = req.get("id")
                key = (self.sandbox_id, rid) if isinstance(rid, int) else None
                answer = self.replays.get(key) if key is not None else None
                if answer is None:
                    answer = await asyncio.to_thread(self._answer, req, payload)
                    if key is not None and req.get("op") in wire.MUTATIONS:
                        self.replays.put(key, answer)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass                                   # the guest hung up (or was paused)
        except wire.ProtocolError as exc:
            log.warning("sandbox %s: volume connection dropped: %s", self.sandbox_id, exc)
        finally:
            self._conns.discard(task)
            writer.close()
