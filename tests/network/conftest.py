"""Fixtures for host/network tests: real namespaces, no VM.

Topology of `world` (all namespaces created here, removed afterwards):

    guest netns (fake VM) ─veth─ br0 [sandbox netns] eth0 ─veth─ <prefix><slot> [fake host netns]
        192.168.127.2/30           .1/30                              up0 198.51.100.1/24
                                                                        │ veth
                                                      [internet netns] eth0 198.51.100.10, .20/24
                                                                        lo 10.99.0.10, 169.254.169.254

The fake host namespace plays the node (`NetworkManagerConfig.host_netns`), so the tests
never touch the real host's forwarding switch or firewall. The fake guest is a veth in the
sandbox bridge instead of QEMU's TAP: the guest's packets reach the same bridge and go
through the same routes and nftables rules (test_qemu_tap.py shows QEMU opens the TAP).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from host.network import (
    NetworkManager,
    NetworkManagerConfig,
    NetworkPolicy,
    SandboxNetwork,
    probe_capability,
)
from host.network.sandbox import BRIDGE_NAME, GATEWAY_IP, GUEST_IP, GUEST_MAC

from .netns_util import LoopThread, TcpServer, ip_batch, netns_exists, sh, wait_until

TAG = f"t{os.getpid() % 0xFFFF:04x}"
PREFIX = f"{TAG}-"  # the managers' prefix in tests: namespaces t1234-<id>, veths t1234-<slot>
INFRA = f"{TAG}x-"  # test-made namespaces; never matches PREFIX
PORT = 8000
INET_A, INET_B = "198.51.100.10", "198.51.100.20"  # "public" servers (TEST-NET-2, ours)
PRIVATE, METADATA = "10.99.0.10", "169.254.169.254"
HOST_UPLINK = "198.51.100.1"
_counter = itertools.count()


@pytest.fixture(scope="session")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def netns_capable(loop: LoopThread) -> None:
    cap = loop.run(probe_capability(PREFIX))
    if not cap.available:
        reason = f"network namespaces unavailable: {cap.reason}"
        print(reason)
        pytest.skip(reason)


def _add_netns(name: str) -> str:
    sh(["ip", "netns", "add", name])
    ip_batch(name, ["link set lo up"])
    return name


def _del_netns(name: str) -> None:
    sh(["ip", "netns", "del", name], check=False)
    assert not netns_exists(name), f"namespace {name} still exists"


def _port_forwarding(netns: str, port: str) -> bool:
    out = json.loads(sh(["bridge", "-n", netns, "-j", "link", "show", "dev", port]) or "[]")
    return bool(out) and out[0].get("state") == "forwarding"


def _oper_up(netns: str, dev: str) -> bool:
    out = json.loads(sh(["ip", "-n", netns, "-j", "link", "show", "dev", dev]) or "[]")
    return bool(out) and out[0].get("operstate") == "UP"


@dataclass
class World:
    loop: LoopThread
    host: str
    inet: str
    manager: NetworkManager
    servers: list[TcpServer] = field(default_factory=list)
    guests: list[str] = field(default_factory=list)

    def create(self, sandbox_id: str, policy: NetworkPolicy | None = None,
               *, guest: bool = True) -> tuple[SandboxNetwork, str | None]:
        net = self.loop.run(self.manager.create(sandbox_id, policy))
        return net, (self.attach_guest(net) if guest else None)

    def attach_guest(self, net: SandboxNetwork) -> str:
        """A namespace with the guest's IP and MAC, plugged into the sandbox bridge."""
        name = _add_netns(f"{INFRA}g{next(_counter)}")
        self.guests.append(name)
        ip_batch(net.netns, [
            f"link add gport type veth peer name eth0 netns {name}",
            f"link set gport master {BRIDGE_NAME}",
            "link set gport up",
        ])
        ip_batch(name, [
            f"link set eth0 address {GUEST_MAC}",
            f"addr add {GUEST_IP}/30 dev eth0",
            "link set eth0 up",
            f"route add default via {GATEWAY_IP}",
        ])
        # Fresh veths get carrier through the kernel's linkwatch (up to ~1 s later); until
        # then the bridge port drops frames. QEMU's TAP has carrier long before a guest
        # sends anything, so wait here rather than let first packets vanish.
        assert wait_until(lambda: _port_forwarding(net.netns, "gport")
                          and _oper_up(name, "eth0")), "fake guest link did not come up"
        return name

    def serve(self, netns: str | None, addr: str, name: str, port: int = PORT) -> TcpServer:
        srv = TcpServer(netns, addr, port, name)
        self.servers.append(srv)
        return srv


def _make_internet(host: str, inet: str, host_if: str, host_ip: str, inet_ips: list[str],
                   root: bool = False) -> None:
    prefix_len = 24
    sh(["ip", *([] if root else ["-n", host]), "link", "add", host_if, "type", "veth",
        "peer", "name", "eth0", "netns", inet])
    ip_batch(None if root else host, [
        f"addr add {host_ip}/{prefix_len} dev {host_if}",
        f"link set {host_if} up",
        *([] if root else [f"route add default via {inet_ips[0]}"]),
    ])
    ip_batch(inet, [
        *(f"addr add {a}/{prefix_len} dev eth0" for a in inet_ips),
        "link set eth0 up",
        f"addr add {PRIVATE}/32 dev lo",
        f"addr add {METADATA}/32 dev lo",
    ])


@pytest.fixture
def world(loop: LoopThread, netns_capable: None) -> Iterator[World]:
    n = next(_counter)
    host = _add_netns(f"{INFRA}host{n}")
    # A new namespace inherits ip_forward from the root namespace; the fake host must
    # start with it off (like a fresh node) whatever the real host has set.
    sh(["ip", "netns", "exec", host, "sysctl", "-qw", "net.ipv4.ip_forward=0"])
    inet = _add_netns(f"{INFRA}inet{n}")
    w: World | None = None
    try:
        _make_internet(host, inet, "up0", HOST_UPLINK, [INET_A, INET_B])
        config = NetworkManagerConfig(prefix=PREFIX, pool="10.213.0.0/24", host_netns=host)
        manager = loop.run(NetworkManager(config).open())
        w = World(loop=loop, host=host, inet=inet, manager=manager)
        for addr, name in ((INET_A, "inet-a"), (INET_B, "inet-b"), (PRIVATE, "private"),
                           (METADATA, "metadata")):
            w.serve(inet, addr, name)
        w.serve(host, "0.0.0.0", "host")
        yield w
    finally:
        if w is not None:
            for srv in w.servers:
                srv.close()
            loop.run(w.manager.aclose())
            for g in w.guests:
                _del_netns(g)
        _del_netns(inet)
        _del_netns(host)
    leftovers = [x for x in sh(["ip", "netns", "list"]).split() if x.startswith(TAG)]
    assert not leftovers, f"namespaces left behind: {leftovers}"
