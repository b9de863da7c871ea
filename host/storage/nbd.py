"""An NBD server (fixed newstyle) on a unix socket, serving many named exports from one loop.

Handshake options: EXPORT_NAME, GO, INFO, LIST, ABORT (others get ERR_UNSUP). Commands:
READ, WRITE, FLUSH, TRIM, WRITE_ZEROES, CACHE, DISC, with simple replies. A request past
the end, or too large, gets EINVAL and the connection carries on; a malformed stream closes
that one connection only. READ data goes to the socket with os.sendfile straight from the
layer files' page cache; holes and zeroed extents are sent from a shared zero buffer.

Requests on one connection are served in order (QEMU opens one connection per drive and
tolerates in-order replies); the exports themselves serialize their own state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from .errors import OutOfRangeError, StorageError

log = logging.getLogger(__name__)

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_INFO = 6
OPT_GO = 7

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR_UNSUP = (1 << 31) + 1
REP_ERR_INVALID = (1 << 31) + 3
REP_ERR_UNKNOWN = (1 << 31) + 6

INFO_EXPORT = 0
INFO_NAME = 1
INFO_BLOCK_SIZE = 3

TF_HAS_FLAGS = 1 << 0
TF_READ_ONLY = 1 << 1
TF_SEND_FLUSH = 1 << 2
TF_SEND_FUA = 1 << 3
TF_SEND_TRIM = 1 << 5
TF_SEND_WRITE_ZEROES = 1 << 6
TF_CAN_MULTI_CONN = 1 << 8
TF_SEND_CACHE = 1 << 10

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_FLAG_FUA = 1

MAX_REQUEST = 32 << 20
SMALL_READ = 64 << 10  # below this, gather into one send instead of sendfile
REQ = struct.Struct(">IHHQQI")
REPLY = struct.Struct(">IIQ")
_ZEROS = memoryview(bytes(1 << 20))

Piece = tuple[int | None, int, int, bool]  # (fd or None for zeros, offset, length, owned fd)


class Export(Protocol):
    """What the NBD server needs from one export."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def read_only(self) -> bool: ...

    async def read_pieces(self, offset: int, length: int) -> list[Piece]: ...
    async def write(self, offset: int, data: bytes | bytearray) -> None: ...
    async def flush(self) -> None: ...
    async def write_zeroes(self, offset: int, length: int) -> None: ...


class _Closed(Exception):
    """The peer went away or broke the protocol: drop this connection."""


class _Conn:
    """A non-blocking socket with a small receive buffer, used from the event loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.out: list[bytes] = []  # queued replies, sent in one go
        self.out_bytes = 0

    async def recv(self, n: int) -> bytearray:
        if n <= len(self.buf):
            out = self.buf[:n]
            del self.buf[:n]
            return out
        # about to wait for the peer: everything queued must be on its way first. Batching
        # replies this way (one send per burst of pipelined requests) matters: each send
        # wakes the peer, which costs ~100 us on a small VM.
        await self.flush()
        out = bytearray(n)
        got = len(self.buf)
        out[:got] = self.buf
        self.buf.clear()
        view = memoryview(out)
        while got < n:
            if n - got < 65536:  # small remainder: read ahead to save syscalls
                chunk = await self.loop.sock_recv(self.sock, 262144)
                if not chunk:
                    raise _Closed("eof")
                take = min(len(chunk), n - got)
                view[got:got + take] = chunk[:take]
                self.buf += chunk[take:]
                got += take
            else:
                k = await self.loop.sock_recv_into(self.sock, view[got:])
                if k == 0:
                    raise _Closed("eof")
                got += k
        return out

    def queue(self, data: bytes) -> None:
        """Send `data` soon: before the next wait for the peer or at 256 KiB queued."""
        self.out.append(data)
        self.out_bytes += len(data)

    async def flush(self) -> None:
        if self.out:
            data = b"".join(self.out) if len(self.out) > 1 else self.out[0]
            self.out.clear()
            self.out_bytes = 0
            await self.loop.sock_sendall(self.sock, data)

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        await self.flush()
        await self.loop.sock_sendall(self.sock, data)

    async def sendfile(self, fd: int, offset: int, count: int) -> None:
        out = self.sock.fileno()
        while count > 0:
            try:
                sent = os.sendfile(out, fd, offset, count)
            except BlockingIOError:
                await self._writable()
                continue
            if sent == 0:
                raise _Closed("layer file shorter than its index says")
            offset += sent
            count -= sent

    async def _writable(self) -> None:
        fut = self.loop.create_future()
        fd = self.sock.fileno()
        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, ready)
        try:
            await fut
        finally:
            self.loop.remove_writer(fd)


class NbdServer:
    """Serves exports found by `lookup(name)` on one unix socket."""

    def __init__(self, path: str | os.PathLike[str], lookup: Callable[[str], Export | None],
                 names: Callable[[], list[str]]) -> None:
        self.path = Path(path)
        self.lookup = lookup
        self.names = names
        self._sock: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._conns: dict[asyncio.Task[None], tuple[socket.socket, str | None]] = {}

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.path))
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._accept_task = asyncio.create_task(self._accept_loop(), name="nbd-accept")

    async def aclose(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def disconnect(self, name: str) -> None:
        """Drop every connection to export `name` and wait until they are gone, so the
        caller may close the export's files (no send is left in flight on them)."""
        tasks = [t for t, (_sock, export) in list(self._conns.items()) if export == name]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            task = asyncio.create_task(self._serve(conn))
            self._conns[task] = (conn, None)
            task.add_done_callback(self._conns.pop)

    async def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        try:
            export = await self._negotiate(conn)
            if export is not None:
                task = asyncio.current_task()
                assert task is not None
                self._conns[task] = (sock, export.name)
                await self._transmit(conn, export)
        except (_Closed, ConnectionError, BrokenPipeError):
            pass
        except Exception:
            log.exception("nbd connection failed")
        finally:
            sock.close()

    # --- handshake ---
    async def _opt_reply(self, conn: _Conn, opt: int, rtype: int, data: bytes = b"") -> None:
        await conn.send(struct.pack(">QIII", OPT_REPLY_MAGIC, opt, rtype, len(data)) + data)

    async def _negotiate(self, conn: _Conn) -> Export | None:
        await conn.send(struct.pack(">QQH", NBDMAGIC, IHAVEOPT,
                                    FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        (cflags,) = struct.unpack(">I", await conn.recv(4))
        no_zeroes = bool(cflags & FLAG_NO_ZEROES)
        while True:
            magic, opt, length = struct.unpack(">QII", await conn.recv(16))
            if magic != IHAVEOPT or length > 65536:
                raise _Closed("bad option header")
            data = bytes(await conn.recv(length))
            if opt == OPT_EXPORT_NAME:
                export = self.lookup(data.decode(errors="replace"))
                if export is None:
                    raise _Closed("unknown export")
                await conn.send(struct.pack(">QH", export.size, self._tflags(export))
                                + (b"" if no_zeroes else bytes(124)))
                return export
            if opt == OPT_ABORT:
                with contextlib.suppress(ConnectionError):
                    await self._opt_reply(conn, opt, REP_ACK)
                return None
            if opt == OPT_LIST:
                if data:
                    await self._opt_reply(conn, opt, REP_ERR_INVALID)
                    continue
                for name in self.names():
                    raw = name.encode()
                    await self._opt_reply(conn, opt, REP_SERVER, struct.pack(">I", len(raw)) + raw)
                await self._opt_reply(conn, opt, REP_ACK)
            elif opt in (OPT_INFO, OPT_GO):
                export = await self._info(conn, opt, data)
                if export is not None and opt == OPT_GO:
                    return export
            else:
                await self._opt_reply(conn, opt, REP_ERR_UNSUP)

    async def _info(self, conn: _Conn, opt: int, data: bytes) -> Export | None:
        if len(data) < 6:
            await self._opt_reply(conn, opt, REP_ERR_INVALID)
            return None
        (nlen,) = struct.unpack_from(">I", data)
        if 4 + nlen + 2 > len(data):
            await self._opt_reply(conn, opt, REP_ERR_INVALID)
            return None
        name = data[4:4 + nlen].decode(errors="replace")
        (nreq,) = struct.unpack_from(">H", data, 4 + nlen)
        if len(data) != 4 + nlen + 2 + 2 * nreq:
            await self._opt_reply(conn, opt, REP_ERR_INVALID)
            return None
        reqs = struct.unpack_from(f">{nreq}H", data, 4 + nlen + 2)
        export = self.lookup(name)
        if export is None:
            await self._opt_reply(conn, opt, REP_ERR_UNKNOWN, f"no export {name!r}".encode())
            return None
        await self._opt_reply(conn, opt, REP_INFO,
                              struct.pack(">HQH", INFO_EXPORT, export.size, self._tflags(export)))
        if INFO_NAME in reqs:
            await self._opt_reply(conn, opt, REP_INFO, struct.pack(">H", INFO_NAME) + name.encode())
        await self._opt_reply(conn, opt, REP_INFO,
                              struct.pack(">HIII", INFO_BLOCK_SIZE, 512, 4096, MAX_REQUEST))
        await self._opt_reply(conn, opt, REP_ACK)
        return export

    @staticmethod
    def _tflags(export: Export) -> int:
        f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_CAN_MULTI_CONN | TF_SEND_CACHE
        if export.read_only:
            return f | TF_READ_ONLY
        return f | TF_SEND_TRIM | TF_SEND_WRITE_ZEROES

    # --- transmission ---
    async def _transmit(self, conn: _Conn, export: Export) -> None:
        while True:
            magic, flags, cmd, handle, offset, length = REQ.unpack(await conn.recv(REQ.size))
            if magic != REQUEST_MAGIC:
                raise _Closed("bad request magic")
            if cmd == CMD_DISC:
                await conn.flush()
                return
            data = None
            if cmd == CMD_WRITE:
                if length > MAX_REQUEST:
                    raise _Closed("write payload too large to skip safely")
                data = await conn.recv(length)
            err = self._check(export, cmd, offset, length)
            if err:
                conn.queue(REPLY.pack(SIMPLE_REPLY_MAGIC, err, handle))
                continue
            try:
                if cmd == CMD_READ:
                    pieces = await export.read_pieces(offset, length)
                    await self._send_read(conn, handle, pieces, length)
                    continue
                if cmd == CMD_WRITE:
                    assert data is not None
                    await export.write(offset, data)
                    if flags & CMD_FLAG_FUA:
                        await export.flush()
                elif cmd == CMD_FLUSH:
                    await export.flush()
                elif cmd == CMD_CACHE:  # prefetch: pulls remote chunks into the cache
                    for fd, _o, _n, owned in await export.read_pieces(offset, length):
                        if owned and fd is not None:
                            os.close(fd)
                elif cmd in (CMD_TRIM, CMD_WRITE_ZEROES):
                    await export.write_zeroes(offset, length)
                    if flags & CMD_FLAG_FUA:
                        await export.flush()
                err = 0
            except asyncio.CancelledError:
                raise
            except OutOfRangeError:
                err = errno.EINVAL
            except (StorageError, OSError, EOFError) as exc:
                log.warning("nbd %s: cmd %d at %d+%d failed: %s", export.name, cmd, offset,
                            length, exc)
                err = errno.EIO
            conn.queue(REPLY.pack(SIMPLE_REPLY_MAGIC, err, handle))
            if conn.out_bytes >= 262144:
                await conn.flush()

    @staticmethod
    def _check(export: Export, cmd: int, offset: int, length: int) -> int:
        if cmd not in (CMD_READ, CMD_WRITE, CMD_FLUSH, CMD_TRIM, CMD_WRITE_ZEROES, CMD_CACHE):
            return errno.EINVAL
        if cmd == CMD_FLUSH:
            return 0
        if offset + length > export.size:
            return errno.EINVAL
        if cmd == CMD_READ and length > MAX_REQUEST:
            return errno.EINVAL
        if export.read_only and cmd in (CMD_WRITE, CMD_TRIM, CMD_WRITE_ZEROES):
            return errno.EPERM
        return 0

    async def _send_read(self, conn: _Conn, handle: int, pieces: list[Piece], length: int) -> None:
        header = REPLY.pack(SIMPLE_REPLY_MAGIC, 0, handle)
        try:
            if length <= SMALL_READ:
                parts = [header]
                for fd, off, n, _owned in pieces:
                    part = bytes(n) if fd is None else os.pread(fd, n, off)
                    if len(part) != n:
                        raise _Closed("layer file shorter than its index says")
                    parts.append(part)
                conn.queue(b"".join(parts))
                if conn.out_bytes >= 262144:
                    await conn.flush()
                return
            await conn.send(header)
            for fd, off, n, _owned in pieces:
                if fd is None:
                    while n > 0:
                        k = min(n, len(_ZEROS))
                        await conn.send(_ZEROS[:k])
                        n -= k
                else:
                    await conn.sendfile(fd, off, n)
        finally:
            for fd, _off, _n, owned in pieces:
                if owned and fd is not None:
                    os.close(fd)
