"""A private network namespace in which `*.<domain>` is this host on port 443, for running
the unmodified SDKs in pure E2B_DOMAIN mode (no E2B_API_URL / E2B_SANDBOX_URL) against a
service on its test ports.

Test infrastructure, not a fake of our code: a deployment resolves `*.<domain>` to the node
(wildcard DNS) and maps :443 to the proxy listener (port mapping / load balancer). Here:

* name resolution: `ip netns exec NAME` bind-mounts /etc/netns/NAME/nsswitch.conf over
  /etc/nsswitch.conf for the command; ours says `hosts: files myhostname`, and
  libnss-myhostname answers every `*.localhost` name with 127.0.0.1 / ::1. The global
  /etc/nsswitch.conf is not touched. (pyqwest, the Python SDK's Rust HTTP client, does not
  even ask NSS: its hickory resolver answers `*.localhost` with loopback itself, RFC 6761.
  Node's dns.lookup and Python's socket.getaddrinfo go through NSS.)
* port 443: a byte relay owned by the test. Its listening sockets are created inside the
  namespace (127.0.0.1:443 and [::1]:443; clients try ::1 first) by a short-lived thread
  that joins the namespace with setns(2); sockets keep the namespace they were made in.
  Accepted connections are forwarded to the service's proxy port on 127.0.0.1 in the root
  namespace. It relays TCP bytes only, so TLS stays end to end (SNI, certificate, ALPN
  are the service's own).

`DomainNet.close()` removes everything it made: relay sockets and threads, the namespace,
/etc/netns/NAME (and /etc/netns when it made it and it is empty).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class DomainNet:
    def __init__(self, name: str, upstream_port: int, *, port: int = 443) -> None:
        self.name = name
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = port
        self.etc = Path("/etc/netns") / name
        self._stop = threading.Event()
        self._listeners: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.connections = 0  # accepted so far (the tests check the relay was used)
        self._made_parent = False  # /etc/netns did not exist before us

    # ---- setup ---------------------------------------------------------------------------

    def open(self) -> DomainNet:
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self._made_parent = not self.etc.parent.exists()
        self.etc.mkdir(parents=True)
        (self.etc / "nsswitch.conf").write_text("hosts: files myhostname\n")
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        self._listeners = self._listen_inside()
        for ls in self._listeners:
            self._spawn(self._accept_loop, ls)
        return self

    def _listen_inside(self) -> list[socket.socket]:
        made: list[socket.socket] = []
        errors: list[BaseException] = []

        def work() -> None:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            target = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
            try:
                _setns(target)
                try:
                    for family, addr in ((socket.AF_INET, "127.0.0.1"),
                                         (socket.AF_INET6, "::1")):
                        s = socket.socket(family, socket.SOCK_STREAM)
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                        if family == socket.AF_INET6:
                            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                        s.bind((addr, self.port))
                        s.listen(64)
                        s.settimeout(0.2)
                        made.append(s)
                finally:
                    _setns(home)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
            finally:
                os.close(target)
                os.close(home)

        # a thread of its own: only the calling thread changes namespace with setns(2)
        t = threading.Thread(target=work, name=f"netns-listen-{self.name}")
        t.start()
        t.join()
        if errors:
            for s in made:
                s.close()
            raise errors[0]
        return made

    # ---- relay ---------------------------------------------------------------------------

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True,  # type: ignore[arg-type]
                             name=f"relay-{self.name}")
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                up = socket.create_connection(self.upstream, timeout=30)
            except OSError:
                client.close()
                continue
            up.settimeout(None)
            with self._lock:
                self.connections += 1
                self._conns.update((client, up))
            pending = [2]  # pumps of this connection still running
            self._spawn(self._pump, client, up, pending)
            self._spawn(self._pump, up, client, pending)

    def _pump(self, src: socket.socket, dst: socket.socket, pending: list[int]) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        with self._lock:
            pending[0] -= 1
            if pending[0] == 0:  # both directions done
                for s in (src, dst):
                    self._conns.discard(s)
                    s.close()

    # ---- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks = [*self._listeners, *self._conns]
            self._conns.clear()
            threads = list(self._threads)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in threads:
            t.join(timeout=5)
        subprocess.run(["ip", "netns", "delete", self.name], check=False,
                       capture_output=True)
        shutil.rmtree(self.etc, ignore_errors=True)
        if self._made_parent:
            with contextlib.suppress(OSError):  # only if empty: another run may use it now
                self.etc.parent.rmdir()

    def exec_argv(self, *argv: str) -> list[str]:
        """`argv` run inside the namespace (with its nsswitch.conf)."""
        return ["ip", "netns", "exec", self.name, *argv]
