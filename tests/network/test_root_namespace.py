"""The production layout: the host side in the real root namespace (host_netns=None).

Forwarding is switched on per interface (`uplinks`), never globally, so other users of
this host are unaffected; the "internet" is a namespace made here, reached over a veth
with TEST-NET-3 addresses.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator

import pytest

from host.network import NetworkManager, NetworkManagerConfig, NetworkPolicy

from .conftest import INFRA, PORT, TAG, World, _add_netns, _del_netns, _make_internet
from .netns_util import (
    LoopThread,
    TcpServer,
    links,
    netns_exists,
    nft_tables,
    sh,
    sysctl,
    try_tcp,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)
UPLINK = f"{TAG}up"
INET = "203.0.113.10"


def _free_pool() -> str:
    routes = json.loads(sh(["ip", "-j", "route", "show", "table", "all"]) or "[]")
    used = []
    for r in routes:
        try:
            used.append(ipaddress.ip_network(r.get("dst", ""), strict=False))
        except ValueError:
            continue
    for third in range(215, 250):
        cand = ipaddress.ip_network(f"10.{third}.0.0/24")
        if not any(u.version == 4 and u.prefixlen > 0 and cand.overlaps(u) for u in used):
            return str(cand)
    pytest.skip("no free 10.x.0.0/24 for a test pool in the root namespace")


@pytest.fixture
def root_world(loop: LoopThread, netns_capable: None) -> Iterator[World]:
    inet = _add_netns(f"{INFRA}rinet")
    manager = None
    servers: list[TcpServer] = []
    w = None
    try:
        _make_internet("", inet, UPLINK, "203.0.113.1", [INET], root=True)
        # A new link inherits conf.default.forwarding, which is on wherever something set
        # the global ip_forward; start from off like a node whose uplink doesn't forward.
        sh(["sysctl", "-qw", f"net.ipv4.conf.{UPLINK}.forwarding=0"])
        cfg = NetworkManagerConfig(prefix=f"{TAG}-", pool=_free_pool(), uplinks=(UPLINK,))
        manager = loop.run(NetworkManager(cfg).open())
        w = World(loop=loop, host="", inet=inet, manager=manager, servers=servers)
        w.serve(inet, INET, "inet")
        yield w
    finally:
        for srv in servers:
            srv.close()
        if manager is not None:
            loop.run(manager.aclose())
        if w is not None:
            for g in w.guests:
                _del_netns(g)
        sh(["ip", "link", "del", UPLINK], check=False)  # netns teardown is asynchronous
        _del_netns(inet)
    assert UPLINK not in links(None)
    assert wait_until(lambda: not [x for x in links(None) if x.startswith(f"{TAG}-")])


def test_root_namespace_egress_dnat_and_cleanup(root_world: World) -> None:
    w = root_world
    net, guest = w.create("rootsbx")
    assert sysctl(None, f"net.ipv4.conf.{UPLINK}.forwarding") == "1"
    assert sysctl(None, f"net.ipv4.conf.{net.host_ifname}.forwarding") == "1"
    assert try_tcp(guest, INET, PORT) == "inet"
    assert w.servers[0].peers == ["203.0.113.1"]
    # the real host reaches the guest through the DNAT'ed address
    w.serve(guest, "0.0.0.0", "guest", port=49983)
    assert try_tcp(None, *net.guest_address(49983)) == "guest"
    w.loop.run(w.manager.update_policy("rootsbx", NetworkPolicy(allow_internet_access=False)))
    assert try_tcp(guest, INET, PORT) is None
    assert try_tcp(None, *net.guest_address(49983)) == "guest"
    # only the uplink's switch was touched, never the global one
    assert list(w.manager._restore_sysctl) == [f"net.ipv4.conf.{UPLINK}.forwarding"]
    table = f"table ip {TAG}_host"
    assert table in nft_tables(None)
    w.loop.run(w.manager.aclose())
    assert not netns_exists(net.netns)
    assert wait_until(lambda: net.host_ifname not in links(None))
    assert table not in nft_tables(None)
    assert sysctl(None, f"net.ipv4.conf.{UPLINK}.forwarding") == "0"  # restored
