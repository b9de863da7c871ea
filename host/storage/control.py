"""The block server's control API: newline-delimited JSON over a unix socket, and its clients.

Request:  {"op": "create", "args": {...}}\\n
Reply:    {"ok": true, "result": ...}\\n  or  {"ok": false, "error": {"type": ..., "message": ...}}\\n

One request per connection keeps the client trivially robust (no pipelining state, a
crashed server shows up as a connection error on the next call). Error types named in
host.storage.errors come back as those classes; anything else as ControlError.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import errors
from .errors import ControlError, StorageError

NBD_SOCKET = "nbd.sock"
CONTROL_SOCKET = "control.sock"
_OWN_NAME_MAX = 40  # longer stack names are hashed: a unix socket path has 107 bytes


def own_socket(socket_dir: Path, stack: str) -> Path:
    """The socket that serves `stack` alone (`<socket dir>/x/<stack>/nbd.sock`)."""
    key = stack if len(stack) <= _OWN_NAME_MAX else hashlib.sha256(stack.encode()).hexdigest()[:32]
    return socket_dir / "x" / key / NBD_SOCKET


@dataclass(frozen=True)
class StackInfo:
    """What a VMM needs to attach a stack: the NBD socket and the export name."""

    name: str
    layers: tuple[str, ...]
    virtual_size: int
    nbd_socket: str

    @property
    def export(self) -> str:
        return self.name

    @property
    def nbd_uri(self) -> str:
        """For qemu-io / qemu-img: nbd+unix:///NAME?socket=SOCK."""
        return f"nbd+unix:///{self.name}?socket={self.nbd_socket}"

    def qemu_drive(self, drive_id: str, *, cache: str = "none") -> str:
        """A `-drive` value for QEMU (attach with `-device virtio-blk-device,drive=ID`)."""
        return (f"file.driver=nbd,file.server.type=unix,file.server.path={self.nbd_socket},"
                f"file.export={self.name},format=raw,if=none,cache={cache},id={drive_id}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": list(self.layers),
                "virtual_size": self.virtual_size, "nbd_socket": self.nbd_socket}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StackInfo:
        return cls(name=d["name"], layers=tuple(d["layers"]), virtual_size=int(d["virtual_size"]),
                   nbd_socket=d["nbd_socket"])


def error_reply(exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc)}}


def raise_error(err: dict[str, Any]) -> None:
    cls = getattr(errors, str(err.get("type")), None)
    msg = str(err.get("message", ""))
    if isinstance(cls, type) and issubclass(cls, StorageError):
        raise cls(msg)
    raise ControlError(f"{err.get('type')}: {msg}")


def _result(raw: bytes) -> Any:
    if not raw:
        raise ControlError("block server closed the control connection without a reply")
    reply = json.loads(raw)
    if not reply.get("ok"):
        raise_error(reply.get("error", {}))
    return reply.get("result")




class BlockServerClient:
    """Async client of the control API (used by the orchestrator)."""

    def __init__(self, socket_path: str | Path, *, timeout_s: float = 120.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout_s = timeout_s

    async def _call(self, op: str, *, wait_s: float | None = None, **args: Any) -> Any:
        try:
            async with asyncio.timeout(wait_s or self.timeout_s):
                reader, writer = await asyncio.open_unix_connection(self.socket_path,
                                                                    limit=1 << 24)
                try:
                    writer.write(json.dumps({"op": op, "args": args}).encode() + b"\n")
                    await writer.drain()
                    raw = await reader.readline()
                finally:
                    writer.close()
        except OSError as exc:
            raise ControlError(f"block server at {self.socket_path}: {exc}") from exc
        return _result(raw)

    async def ping(self) -> bool:
        return bool(await self._call("ping"))

    async def create(self, name: str, layers: list[str] | tuple[str, ...] = (), *,
                     virtual_size: int | None = None) -> StackInfo:
        """New stack `name` over sealed `layers` (bottom first) with an empty upper."""
        return StackInfo.from_dict(await self._call("create", name=name, layers=list(layers),
                                                    virtual_size=virtual_size))

    async def seal(self, name: str, *, upload: bool = True, user_tag: str = "") -> str:
        """Snapshot: seal the upper into a new layer (O(1)); returns its digest. With
        upload=True it returns only once the layer is in the repository."""
        return str(await self._call("seal", name=name, upload=upload, user_tag=user_tag))

    async def clone(self, source: str, name: str, *, upload: bool = False) -> StackInfo:
        """Fork: seal the source's upper if dirty, then a new stack over the same layers."""
        return StackInfo.from_dict(await self._call("clone", source=source, name=name,
                                                    upload=upload))

    async def delete(self, name: str) -> None:
        await self._call("delete", name=name)

    async def info(self, name: str) -> StackInfo:
        return StackInfo.from_dict(await self._call("info", name=name))

    async def list(self) -> list[StackInfo]:
        return [StackInfo.from_dict(d) for d in await self._call("list")]

    async def flush(self, name: str) -> None:
        await self._call("flush", name=name)

    async def prehash(self, name: str) -> None:
        """A seal of `name` is coming: the server hashes its upper meanwhile."""
        await self._call("prehash", name=name)

    async def import_layer(self, path: str | Path, *, upload: bool = True) -> str:
        """Adopt a sealed layer file (e.g. from convert) into the server; returns its digest."""
        return str(await self._call("import_layer", path=str(path), upload=upload))

    async def export_raw(self, name: str, path: str | Path, *, wait_s: float = 1800.0) -> int:
        """Write stack `name` as a sparse raw image at the new file `path`; returns the
        data bytes written (`BlockServer.export_raw`)."""
        result = await self._call("export_raw", wait_s=wait_s, name=name, path=str(path))
        return int(result["bytes"])

    async def push(self, digest: str) -> None:
        """Upload a local layer to the repository (durable once this returns)."""
        await self._call("push", digest=digest)

    async def collect(self, keep: builtins.list[str], *, min_age_s: float, dry_run: bool = False,
                      repository: str = "none") -> dict[str, Any]:
        """Remove sealed layers no stack uses and `keep` does not name, older than
        `min_age_s`; `repository`: none, sweep or own (`BlockServer.collect`): {local,
        repository: {files, bytes, digests}, in_use}."""
        result: dict[str, Any] = await self._call(
            "collect", keep=keep, min_age_s=min_age_s, dry_run=dry_run, repository=repository)
        return result

    async def compact(self, name: str, start: int, *, wait_s: float = 3600.0) -> dict[str, Any]:
        """Merge the stack's sealed layers from index `start` up into one, under its upper
        (`BlockServer.compact`): {digest (None: skipped), merged, layers}. It copies the
        run's data, so it may take long: `wait_s` bounds it instead of the usual timeout."""
        result: dict[str, Any] = await self._call("compact", wait_s=wait_s, name=name,
                                                  start=start)
        return result

    async def stats(self) -> dict[str, Any]:
        """The server's counters (`BlockServer.stats`): chunk cache, repository bytes."""
        result: dict[str, Any] = await self._call("stats")
        return result


class SyncBlockServerClient:
    """Blocking twin of BlockServerClient for scripts and tests."""

    def __init__(self, socket_path: str | Path, *, timeout_s: float = 120.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout_s = timeout_s

    def _call(self, op: str, **args: Any) -> Any:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(self.socket_path)
                s.sendall(json.dumps({"op": op, "args": args}).encode() + b"\n")
                buf = bytearray()
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError as exc:
            raise ControlError(f"block server at {self.socket_path}: {exc}") from exc
        return _result(bytes(buf))

    def ping(self) -> bool:
        return bool(self._call("ping"))

    def create(self, name: str, layers: list[str] | tuple[str, ...] = (), *,
               virtual_size: int | None = None) -> StackInfo:
        return StackInfo.from_dict(self._call("create", name=name, layers=list(layers),
                                              virtual_size=virtual_size))

    def seal(self, name: str, *, upload: bool = True, user_tag: str = "") -> str:
        return str(self._call("seal", name=name, upload=upload, user_tag=user_tag))

    def clone(self, source: str, name: str, *, upload: bool = False) -> StackInfo:
        return StackInfo.from_dict(self._call("clone", source=source, name=name, upload=upload))

    def delete(self, name: str) -> None:
        self._call("delete", name=name)

    def info(self, name: str) -> StackInfo:
        return StackInfo.from_dict(self._call("info", name=name))

    def list(self) -> list[StackInfo]:
        return [StackInfo.from_dict(d) for d in self._call("list")]

    def flush(self, name: str) -> None:
        self._call("flush", name=name)

    def import_layer(self, path: str | Path, *, upload: bool = True) -> str:
        return str(self._call("import_layer", path=str(path), upload=upload))

    def push(self, digest: str) -> None:
        self._call("push", digest=digest)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("stats")
        return result
