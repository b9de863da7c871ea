"""Test helpers: sockets inside namespaces, tiny TCP servers, a loop thread, namespaces.

Everything here only talks to addresses the tests create in their own namespaces.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import subprocess
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in_netns(netns: str | None, type_: int = socket.SOCK_STREAM) -> socket.socket:
    """A socket created inside `netns` (it stays there; usable from any thread)."""
    if netns is None:
        return socket.socket(socket.AF_INET, type_)
    box: dict[str, Any] = {}

    def work() -> None:
        # setns affects only this short-lived thread; switch back anyway before it ends.
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                box["sock"] = socket.socket(socket.AF_INET, type_)
            finally:
                _setns(own)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    sock: socket.socket = box["sock"]
    return sock


class TcpServer:
    """Listens in a namespace; each connection gets `<name>\\n`, then its lines echoed.
    `peers` records the source address of each accepted connection."""

    def __init__(self, netns: str | None, addr: str, port: int, name: str) -> None:
        self.name = name
        self.peers: list[str] = []
        self.sock = socket_in_netns(netns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.peers.append(peer[0])
            self._conns.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        try:
            conn.sendall(f"{self.name}\n".encode())
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


def connect(netns: str | None, addr: str, port: int, timeout_s: float = 3.0) -> socket.socket:
    s = socket_in_netns(netns)
    s.settimeout(timeout_s)
    try:
        s.connect((addr, port))
    except BaseException:
        s.close()
        raise
    return s


def try_tcp(netns: str | None, addr: str, port: int, timeout_s: float = 3.0) -> str | None:
    """The server's name if a connection from `netns` to addr:port works, else None."""
    try:
        s = connect(netns, addr, port, timeout_s)
    except OSError:
        return None
    try:
        return s.makefile().readline().strip() or None
    except OSError:
        return None
    finally:
        s.close()


def sh(argv: Sequence[str], *, check: bool = True, input_text: str | None = None) -> str:
    res = subprocess.run(list(argv), check=False, capture_output=True, text=True, input=input_text,
                         timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {res.stderr.strip()}")
    return res.stdout


def ip_batch(netns: str | None, lines: Sequence[str]) -> None:
    sh(["ip", *(["-n", netns] if netns else []), "-batch", "-"], input_text="\n".join(lines) + "\n")


def netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def links(netns: str | None) -> list[str]:
    import json
    out = sh(["ip", *(["-n", netns] if netns else []), "-j", "link", "show"])
    return [link["ifname"] for link in json.loads(out or "[]")]


def nft_tables(netns: str | None) -> list[str]:
    argv = ["nft", "list", "tables"]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return [line.strip() for line in sh(argv).splitlines() if line.strip()]


def sysctl(netns: str | None, key: str) -> str:
    argv = ["sysctl", "-n", key]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return sh(argv).strip()


def wait_until(predicate: Any, timeout_s: float = 5.0) -> bool:
    """Poll `predicate` until true or the deadline passes; returns its last value."""
    import time
    deadline = time.monotonic() + timeout_s
    while not (ok := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(ok)


class LoopThread:
    """An event loop in a background thread; `run(coro)` from sync tests and fixtures."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()
