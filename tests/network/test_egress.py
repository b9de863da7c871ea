"""Egress rules, isolation and DNAT, on real namespaces (see conftest.World)."""

from __future__ import annotations

import pytest

from host.network import NetworkPolicy

from .conftest import HOST_UPLINK, INET_A, INET_B, METADATA, PORT, PRIVATE, World
from .netns_util import connect, socket_in_netns, try_tcp

pytestmark = pytest.mark.timeout(120)


def test_internet_reachable_by_default_through_double_nat(world: World) -> None:
    _, guest = world.create("sbx1")
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    # masqueraded in the sandbox namespace, then by the host onto its uplink
    assert world.servers[0].peers == [HOST_UPLINK]


def test_no_internet_access_blocks_all_egress(world: World) -> None:
    _, guest = world.create("sbx1", NetworkPolicy(allow_internet_access=False))
    assert try_tcp(guest, INET_A, PORT) is None
    assert try_tcp(guest, INET_B, PORT) is None


def test_deny_out_blocks_only_listed_targets(world: World) -> None:
    _, guest = world.create("sbx1", NetworkPolicy(deny_out=(INET_A,)))
    assert try_tcp(guest, INET_A, PORT) is None
    assert try_tcp(guest, INET_B, PORT) == "inet-b"


@pytest.mark.parametrize("policy", [
    NetworkPolicy(allow_internet_access=False, allow_out=(INET_B,)),
    NetworkPolicy(deny_out=("198.51.100.0/24",), allow_out=(f"{INET_B}/32",)),
    NetworkPolicy(deny_out=("0.0.0.0/0",), allow_out=(INET_B, "example.com")),
], ids=["no-internet", "deny-cidr", "deny-all-with-domain"])
def test_allow_out_wins_over_deny(world: World, policy: NetworkPolicy) -> None:
    _, guest = world.create("sbx1", policy)
    assert try_tcp(guest, INET_B, PORT) == "inet-b"
    assert try_tcp(guest, INET_A, PORT) is None


def test_private_and_metadata_ranges_denied_by_default(world: World) -> None:
    _, guest = world.create("sbx1")
    assert try_tcp(guest, INET_A, PORT) == "inet-a"  # the path itself works
    assert try_tcp(guest, PRIVATE, PORT) is None
    assert try_tcp(guest, METADATA, PORT) is None


def test_private_target_reachable_when_explicitly_allowed(world: World) -> None:
    _, guest = world.create("sbx1", NetworkPolicy(allow_out=("10.99.0.0/16",)))
    assert try_tcp(guest, PRIVATE, PORT) == "private"
    assert try_tcp(guest, METADATA, PORT) is None


def test_broad_allow_does_not_open_private_ranges(world: World) -> None:
    _, guest = world.create("sbx1", NetworkPolicy(allow_out=("0.0.0.0/0",)))
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    assert try_tcp(guest, PRIVATE, PORT) is None


def test_host_addresses_denied_by_default(world: World) -> None:
    net, guest = world.create("sbx1")
    # the host's uplink address is public-looking but belongs to the host
    assert try_tcp(guest, HOST_UPLINK, PORT) is None
    assert try_tcp(guest, net.host_ip, PORT) is None


def test_host_address_reachable_when_explicitly_allowed(world: World) -> None:
    _, guest = world.create("sbx1", NetworkPolicy(allow_out=(HOST_UPLINK,)))
    assert try_tcp(guest, HOST_UPLINK, PORT) == "host"
    # another sandbox is not affected by sbx1's allowOut
    _, guest2 = world.create("sbx2")
    assert try_tcp(guest2, HOST_UPLINK, PORT) is None


@pytest.mark.parametrize("allow", [(), ("10.0.0.0/8",)], ids=["default", "pool-allowed"])
def test_sandboxes_cannot_reach_each_other(world: World, allow: tuple[str, ...]) -> None:
    net_a, guest_a = world.create("sbxa", NetworkPolicy(allow_out=allow))
    net_b, guest_b = world.create("sbxb", NetworkPolicy(allow_out=allow))
    world.serve(guest_a, "0.0.0.0", "guest-a", port=9000)
    world.serve(guest_b, "0.0.0.0", "guest-b", port=9000)
    # the host reaches both ...
    assert try_tcp(world.host, net_a.address, 9000) == "guest-a"
    assert try_tcp(world.host, net_b.address, 9000) == "guest-b"
    # ... but they do not reach each other (nor the other's veth ends)
    assert try_tcp(guest_a, net_b.address, 9000) is None
    assert try_tcp(guest_b, net_a.address, 9000) is None
    assert try_tcp(guest_a, net_b.host_ip, PORT) is None


def test_host_reaches_guest_port_through_dnat(world: World) -> None:
    net, guest = world.create("sbx1", NetworkPolicy(allow_internet_access=False))
    srv = world.serve(guest, "0.0.0.0", "guest", port=49983)
    assert net.guest_address(49983) == (net.address, 49983)
    assert try_tcp(world.host, *net.guest_address(49983)) == "guest"
    assert srv.peers == [net.host_ip]  # the guest sees the host veth address
    # nothing from the internet side may open connections into the sandbox
    assert try_tcp(world.inet, net.address, 49983, timeout_s=1.0) is None


def test_update_policy_applies_to_new_connections(world: World) -> None:
    _, guest = world.create("sbx1")
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    kept = connect(guest, INET_A, PORT)
    try:
        f = kept.makefile("rwb")
        assert f.readline() == b"inet-a\n"
        world.loop.run(world.manager.update_policy("sbx1", NetworkPolicy(deny_out=(INET_A,))))
        assert try_tcp(guest, INET_A, PORT) is None
        assert try_tcp(guest, INET_B, PORT) == "inet-b"
        f.write(b"still here\n")  # the established connection keeps working
        f.flush()
        assert f.readline() == b"still here\n"
    finally:
        kept.close()
    world.loop.run(world.manager.update_policy("sbx1", NetworkPolicy()))
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    assert world.manager.get("sbx1").policy == NetworkPolicy()


def _udp_echo(world: World, addr: str, port: int) -> None:
    import socket
    import threading

    sock = socket_in_netns(world.inet, socket.SOCK_DGRAM)
    sock.bind((addr, port))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(2048)
            except TimeoutError:
                continue
            sock.sendto(data, peer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    class _Closer:
        def close(self) -> None:
            stop.set()
            t.join(timeout=5)
            sock.close()

    world.servers.append(_Closer())  # type: ignore[arg-type]


def _udp_roundtrip(netns: str | None, addr: str, port: int) -> bool:
    import socket

    s = socket_in_netns(netns, socket.SOCK_DGRAM)
    s.settimeout(1.0)
    try:
        s.sendto(b"ping", (addr, port))
        return s.recvfrom(2048)[0] == b"ping"
    except OSError:
        return False
    finally:
        s.close()


def test_udp_follows_the_same_rules(world: World) -> None:
    _udp_echo(world, INET_A, 5353)
    _udp_echo(world, INET_B, 5353)
    _, guest = world.create("sbx1", NetworkPolicy(deny_out=(INET_A,)))
    assert _udp_roundtrip(guest, INET_B, 5353)
    assert not _udp_roundtrip(guest, INET_A, 5353)
    world.loop.run(world.manager.update_policy("sbx1", NetworkPolicy(allow_internet_access=False)))
    assert not _udp_roundtrip(guest, INET_B, 5353)
