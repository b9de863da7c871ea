"""Egress of REAL VMs (namespaced networking, host side in the real root namespace).

A fake "internet" namespace made here is attached to the root namespace with an uplink veth
(TEST-NET-2 addresses: root 198.51.100.1, servers 198.51.100.10 and .20). Guests run `curl`
through the e2b SDK: the default policy reaches the servers; allow_internet_access=False,
deny_out and the default-denied space (other sandboxes' addresses) do not.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest

from host.contract import Placement, SnapshotRef
from host.network.sandbox import GUEST_IP
from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime
from tests.network.netns_util import TcpServer, ip_batch, links, netns_exists, sh, wait_until

from .helpers import assert_gone, background, sdk, write

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

TAG = f"egv{os.getpid() % 0xFFFF:04x}"
INET_NS = f"{TAG}-inet"
UPLINK = f"{TAG}up"           # root side of the veth to the fake internet
ROOT_IP = "198.51.100.1"
SRV_A, SRV_B = "198.51.100.10", "198.51.100.20"
PORT = 8080
GUEST_PORT = 8081             # a listener inside sandbox B
NET = NetworkConfig()


class HttpMarker(TcpServer):
    """Answers every HTTP request with `<name>` (one response per connection)."""

    def _echo(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            body = self.name.encode()
            conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        finally:
            conn.close()


@dataclass
class Internet:
    servers: dict[str, HttpMarker]


@pytest.fixture(scope="module")
def internet() -> Iterator[Internet]:
    assert not netns_exists(INET_NS)
    servers: dict[str, HttpMarker] = {}
    sh(["ip", "netns", "add", INET_NS])
    try:
        ip_batch(INET_NS, ["link set lo up"])
        sh(["ip", "link", "add", UPLINK, "type", "veth", "peer", "name", "eth0", "netns", INET_NS])
        ip_batch(None, [f"addr add {ROOT_IP}/24 dev {UPLINK}", f"link set {UPLINK} up"])
        ip_batch(INET_NS, [f"addr add {SRV_A}/24 dev eth0", f"addr add {SRV_B}/24 dev eth0",
                           "link set eth0 up"])
        for addr, name in ((SRV_A, "inet-a-marker"), (SRV_B, "inet-b-marker")):
            servers[addr] = HttpMarker(INET_NS, addr, PORT, name)

        def root_reaches() -> bool:
            try:
                with urllib.request.urlopen(f"http://{SRV_A}:{PORT}/", timeout=1) as r:
                    return bool(r.read() == b"inet-a-marker")
            except OSError:
                return False
        assert wait_until(root_reaches, 10), "fake internet not reachable from the root namespace"
        servers[SRV_A].peers.clear()
        yield Internet(servers)
    finally:
        for srv in servers.values():
            srv.close()
        sh(["ip", "link", "del", UPLINK], check=False)
        sh(["ip", "netns", "del", INET_NS], check=False)
    assert not netns_exists(INET_NS)
    assert UPLINK not in links(None)


@pytest.fixture(scope="module")
async def netns_runtime(runtime: NodeRuntime) -> NodeRuntime:
    if runtime.mode != "netns":
        pytest.skip(f"runtime uses {runtime.mode} networking, not network namespaces")
    return runtime


async def curl(p: Placement, url: str) -> tuple[int, str]:
    """(curl's exit code, body) from inside the guest."""
    def go() -> tuple[int, str]:
        r = sdk(p).commands.run(f"curl -s --max-time 5 {url}; echo \" rc=$?\"", timeout=60)
        out = str(r.stdout)
        body, _, rc = out.rpartition(" rc=")
        return int(rc.strip()), body
    return await asyncio.to_thread(go)


async def reaches(p: Placement, host: str, port: int = PORT) -> str | None:
    rc, body = await curl(p, f"http://{host}:{port}/")
    return body if rc == 0 else None


@pytest.fixture(scope="module")
async def pair(netns_runtime: NodeRuntime, template: SnapshotRef,
               internet: Internet) -> AsyncIterator[tuple[Placement, Placement]]:
    rt = netns_runtime
    started: list[str] = []
    try:
        a = await rt.start("egva", template, NET)
        started.append("egva")
        b = await rt.start("egvb", template, NetworkConfig(deny_out=(f"{SRV_A}/32",)))
        started.append("egvb")
        yield a, b
    finally:
        for sid in started:
            await rt.kill(sid)
        for sid in started:
            await assert_gone(rt, sid)


async def test_default_policy_reaches_internet_then_denied_then_restored(
        netns_runtime: NodeRuntime, pair: tuple[Placement, Placement],
        internet: Internet) -> None:
    rt, (a, _) = netns_runtime, pair
    t0 = time.perf_counter()
    assert await reaches(a, SRV_A) == "inet-a-marker"
    assert await reaches(a, SRV_B) == "inet-b-marker"
    # the guest is masqueraded behind the root namespace's uplink address
    assert set(internet.servers[SRV_A].peers) == {ROOT_IP}

    await rt.update_network("egva", NetworkConfig(allow_internet_access=False))
    rc, body = await curl(a, f"http://{SRV_A}:{PORT}/")
    assert rc != 0 and "marker" not in body, (rc, body)
    assert await reaches(a, SRV_B) is None
    # allowOut wins over the blanket deny
    await rt.update_network("egva", NetworkConfig(allow_internet_access=False,
                                                  allow_out=(SRV_B,)))
    assert await reaches(a, SRV_B) == "inet-b-marker"
    assert await reaches(a, SRV_A) is None

    await rt.update_network("egva", NET)
    assert await reaches(a, SRV_A) == "inet-a-marker"
    print(f"\negress checks: {time.perf_counter() - t0:.1f}s")


async def test_deny_out_at_start_blocks_only_that_address(pair: tuple[Placement, Placement]
                                                          ) -> None:
    _, b = pair
    assert await reaches(b, SRV_A) is None
    assert await reaches(b, SRV_B) == "inet-b-marker"


async def test_start_without_internet_access(netns_runtime: NodeRuntime, template: SnapshotRef,
                                             internet: Internet) -> None:
    rt = netns_runtime
    p = await rt.start("egvc", template, NetworkConfig(allow_internet_access=False))
    try:
        assert await reaches(p, SRV_A) is None
        assert await reaches(p, SRV_B) is None
    finally:
        await rt.kill("egvc")
    await assert_gone(rt, "egvc")


async def test_sandboxes_cannot_reach_each_other(pair: tuple[Placement, Placement]) -> None:
    a, b = pair
    b_host, b_envd = b.address(49983)
    a_host, _ = a.address(49983)
    assert a_host != b_host
    # a listener in B: the host reaches it at B's address, A does not
    await write(b, "/tmp/www/index.html", "sbx-b-marker")
    await background(b, f"cd /tmp/www && exec python3 -m http.server {GUEST_PORT}")

    def host_reaches_b() -> bool:
        try:
            with urllib.request.urlopen(f"http://{b_host}:{GUEST_PORT}/", timeout=2) as r:
                return bool(r.read() == b"sbx-b-marker")
        except OSError:
            return False
    assert await asyncio.to_thread(wait_until, host_reaches_b, 30), "B's listener not up"

    assert await reaches(a, b_host, GUEST_PORT) is None
    assert await reaches(a, b_host, b_envd) is None   # B's envd
    rc, _ = await curl(a, f"http://{b_host}:{b_envd}/health")
    assert rc != 0
    # guest IPs: every guest has the same address in its own namespace, so B's guest IP
    # from A is A itself (nothing listens there), never B
    assert await reaches(a, GUEST_IP, GUEST_PORT) is None
    # and the other way round: B cannot reach A's address either
    assert await reaches(b, a_host, 49983) is None
