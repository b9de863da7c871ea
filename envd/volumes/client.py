"""`HostClient`: the guest's end of the volume protocol (wire.py), for FUSE's threads.

Each thread keeps its own connection (one request in flight per connection, no locks).
A broken connection is normal: a pause, resume or fork leaves every connection dead (the
host side is a new namespace), so a request that failed on the wire is sent again on a
new connection, with the same id (the host answers a repeated mutation from its cache),
for up to `RETRY_S` while the host is not listening yet (a resume attaches it shortly).
"""

from __future__ import annotations

import errno
import random
import socket
import threading
import time
from typing import Any

from . import wire

CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 120.0     # a large fsync on the host; past it the request fails (EIO)
RETRY_S = 15.0


class RemoteError(OSError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("the host closed the connection")
        got += k
    return bytes(buf)


class HostClient:
    def __init__(self, host: str, port: int, volume: str) -> None:
        self.address = (host, port)
        self.volume = volume
        self._local = threading.local()

    def _conn(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(ANSWER_TIMEOUT_S)
            self._local.sock = sock
        return sock

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        self._local.sock = None
        if sock is not None:
            sock.close()

    def call(self, op: str, path: str, payload: bytes = b"",
             **args: Any) -> tuple[dict[str, Any], bytes]:
        """Do `op` on the host; raises OSError(errno) with the host's errno."""
        message = wire.encode({"id": random.getrandbits(63), "op": op, "vol": self.volume,
                               "path": path, **args}, payload)
        deadline = time.monotonic() + RETRY_S
        delay = 0.02
        while True:
            try:
                sock = self._conn()
                sock.sendall(message)
                head_len, body_len = wire.sizes(_recv_exact(sock, wire.PREFIX_SIZE))
                header = wire.decode_header(_recv_exact(sock, head_len))
                data = _recv_exact(sock, body_len) if body_len else b""
                break
            except TimeoutError:
                self._drop()
                raise RemoteError(errno.EIO, "the host did not answer") from None
            except (OSError, wire.ProtocolError):
                self._drop()
                if time.monotonic() > deadline:
                    raise RemoteError(errno.EIO, "the host's volume server is unreachable") \
                        from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        code = header.get("errno")
        if code:
            raise RemoteError(int(code), f"{op} {path}")
        return header, data
