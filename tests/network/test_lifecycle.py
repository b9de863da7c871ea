"""create/destroy/aclose/recover leave nothing behind; errors are the documented ones."""

from __future__ import annotations

import os

import pytest

from host.network import (
    NetworkManager,
    NetworkManagerConfig,
    NetworkPolicy,
    NetworkUnavailableError,
    SandboxNetwork,
    SandboxNetworkExistsError,
    SandboxNetworkNotFoundError,
)
from host.network.commands import netns_inode, pids_in_netns
from host.network.errors import NetworkCleanupError, NetworkCommandError, NetworkError
from host.network.manager import NetworkManager as _NM

from .conftest import INET_A, PORT, PREFIX, World
from .netns_util import links, netns_exists, nft_tables, sh, sysctl, try_tcp, wait_until

pytestmark = pytest.mark.timeout(120)


def test_create_builds_namespace_tap_bridge_and_rules(world: World) -> None:
    net, _ = world.create("sbx1", guest=False)
    assert net.netns == f"{PREFIX}sbx1" and netns_exists(net.netns)
    assert net.host_ifname in links(world.host)
    assert {"lo", "eth0", "br0", "tap0"} <= set(links(net.netns))
    assert "table inet aenv" in nft_tables(net.netns)
    assert sysctl(net.netns, "net.ipv4.ip_forward") == "1"
    assert world.manager.get("sbx1") == net
    tap = sh(["ip", "-n", net.netns, "-d", "link", "show", "tap0"])
    assert "tun type tap" in tap and "master br0" in tap


def test_destroy_removes_everything_and_is_idempotent(world: World) -> None:
    net, guest = world.create("sbx1")
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    world.loop.run(world.manager.destroy("sbx1"))
    assert not netns_exists(net.netns)
    assert "sbx1" not in world.manager.networks
    # the veths go with the sandbox namespace (the kernel frees namespaces asynchronously)
    assert wait_until(lambda: net.host_ifname not in links(world.host))
    assert wait_until(lambda: links(guest) == ["lo"])
    world.loop.run(world.manager.destroy("sbx1"))  # again: no error
    world.loop.run(world.manager.destroy("neverexisted"))
    with pytest.raises(SandboxNetworkNotFoundError):
        world.manager.get("sbx1")
    # the address block is reusable (round robin: a new sandbox gets the next one first)
    net2, _ = world.create("sbx1", guest=False)
    assert net2.slot != net.slot


def test_duplicate_and_invalid_ids_are_rejected(world: World) -> None:
    world.create("sbx1", guest=False)
    with pytest.raises(SandboxNetworkExistsError):
        world.loop.run(world.manager.create("sbx1"))
    with pytest.raises(ValueError):
        world.loop.run(world.manager.create("bad id/../x"))
    with pytest.raises(SandboxNetworkNotFoundError):
        world.loop.run(world.manager.update_policy("nope", NetworkPolicy()))


def test_failed_create_rolls_back(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken_apply(self: _NM, net: object) -> None:
        raise NetworkCommandError(["nft", "-f", "-"], 1, "injected failure")

    monkeypatch.setattr(_NM, "_apply_policy", broken_apply)
    with pytest.raises(NetworkCommandError, match="injected"):
        world.loop.run(world.manager.create("sbx1"))
    assert not netns_exists(f"{PREFIX}sbx1")
    assert wait_until(lambda: not [x for x in links(world.host) if x.startswith(PREFIX)])
    assert world.manager.pool.in_use == frozenset()


def test_destroy_reports_processes_still_in_namespace(world: World) -> None:
    net, _ = world.create("sbx1", guest=False)
    proc = __import__("subprocess").Popen(net.wrap_argv(["sleep", "30"]))
    ino = netns_inode(net.netns)
    assert ino is not None
    try:
        # `ip netns exec` has setns'ed (before it execs sleep): what destroy looks for
        assert wait_until(lambda: str(proc.pid) in pids_in_netns(ino))
        with pytest.raises(NetworkCleanupError, match="still in"):
            world.loop.run(world.manager.destroy("sbx1"))
    finally:
        proc.kill()
        proc.wait()
    assert not netns_exists(net.netns)
    assert net.host_ifname not in links(world.host)  # cut off at once, the process inside


def test_a_slot_comes_round_while_its_old_veth_is_still_going(world: World) -> None:
    """A destroyed network's host veth goes when the kernel frees its namespace, which
    something else may delay (here: an open handle on it). A create that gets the same
    slot meanwhile (a one-slot pool) deletes the old veth and builds its own."""
    host = world.host
    cfg = NetworkManagerConfig(prefix="t3rd-", pool="10.214.0.32/30", host_netns=host)
    nm = world.loop.run(NetworkManager(cfg).open())
    try:
        old = world.loop.run(nm.create("first"))
        pinned = os.open(old.netns_path, os.O_RDONLY)
        try:
            world.loop.run(nm.destroy("first"))
            assert not netns_exists(old.netns)
            assert old.host_ifname in links(host)  # its namespace lives on, pinned
            new = world.loop.run(nm.create("second"))
            assert new.host_ifname == old.host_ifname
            shown = sh(["ip", "-n", host, "-d", "link", "show", new.host_ifname])
            assert f"alias {new.netns}" in shown
            assert "eth0" in links(new.netns)
        finally:
            os.close(pinned)
        world.loop.run(nm.destroy("second"))
        assert wait_until(lambda: not [x for x in links(host) if x.startswith("t3rd-")])
    finally:
        world.loop.run(nm.aclose())


def test_aclose_removes_networks_host_table_and_restores_forwarding(world: World) -> None:
    host = world.host
    cfg = NetworkManagerConfig(prefix="t2nd-", pool="10.214.0.0/28", host_netns=host)
    assert sysctl(host, "net.ipv4.ip_forward") == "1"  # world's manager set it
    # a second manager on the same host does not take ownership of the switch
    nm2 = world.loop.run(NetworkManager(cfg).open())
    net = world.loop.run(nm2.create("other"))
    assert "table ip t2nd_host" in nft_tables(host)
    world.loop.run(nm2.aclose())
    world.loop.run(nm2.aclose())  # idempotent
    assert not netns_exists(net.netns)
    assert "table ip t2nd_host" not in nft_tables(host)
    assert sysctl(host, "net.ipv4.ip_forward") == "1"
    # closing the manager that switched forwarding on restores the prior value
    world.create("sbx1", guest=False)
    world.loop.run(world.manager.aclose())
    assert sysctl(host, "net.ipv4.ip_forward") == "0"
    assert not [t for t in nft_tables(host) if "host" in t]
    assert not netns_exists(f"{PREFIX}sbx1")
    with pytest.raises(NetworkError, match="not open"):
        world.loop.run(world.manager.create("sbx2"))


def test_recover_cleans_leftovers_and_adopts_kept_networks(world: World) -> None:
    world.create("gone1", guest=False)
    world.create("gone2", guest=False)
    kept, guest = world.create("kept", NetworkPolicy(allow_internet_access=False))
    # a stray host veth whose namespace vanished
    sh(["ip", "-n", world.host, "link", "add", f"{PREFIX}63", "type", "veth", "peer", "name",
        "strayp"])
    # "crash": a fresh manager with the same config finds what the first one left
    world.manager._open = False  # the old object is abandoned, not closed
    world.manager = world.loop.run(NetworkManager(world.manager.config).open())
    found = world.loop.run(world.manager.list_existing())
    assert {(e.sandbox_id, e.host_ifname) for e in found} == {
        ("gone1", f"{PREFIX}0"), ("gone2", f"{PREFIX}1"), ("kept", f"{PREFIX}2"),
        (None, f"{PREFIX}63"),
    }
    adopted = world.loop.run(world.manager.recover({"kept": NetworkPolicy()}))
    assert adopted == [kept.__class__(**{**kept.__dict__, "policy": NetworkPolicy()})]
    assert not netns_exists(f"{PREFIX}gone1") and not netns_exists(f"{PREFIX}gone2")
    assert f"{PREFIX}63" not in links(world.host)
    # the veths of gone1 and gone2 go with their namespaces, freed asynchronously
    assert wait_until(lambda: [e.sandbox_id for e in
                               world.loop.run(world.manager.list_existing())] == ["kept"])
    # the adopted network works with its re-applied policy, and its slot stays taken
    assert try_tcp(guest, INET_A, PORT) == "inet-a"
    assert world.manager.pool.in_use == frozenset({kept.slot})


def test_open_reports_unavailable_without_capability(
    loop: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from host.network import probe as probe_mod

    monkeypatch.setattr(probe_mod, "_has_cap_net_admin", lambda: False)
    from .netns_util import LoopThread
    assert isinstance(loop, LoopThread)
    cap = loop.run(NetworkManager.probe())
    assert not cap.available and "CAP_NET_ADMIN" in cap.reason
    with pytest.raises(NetworkUnavailableError, match="CAP_NET_ADMIN"):
        loop.run(NetworkManager(NetworkManagerConfig(prefix="tnone-")).open())


def test_concurrent_creates_and_destroys(world: World) -> None:
    import asyncio

    ids = [f"c{i}" for i in range(8)]

    async def create_all() -> list[SandboxNetwork]:
        return list(await asyncio.gather(*(world.manager.create(i) for i in ids)))

    nets = world.loop.run(create_all())
    assert len({n.address for n in nets}) == len({n.slot for n in nets}) == len(ids)
    guests = [world.attach_guest(n) for n in nets[:2]]
    for g in guests:
        assert try_tcp(g, INET_A, PORT) == "inet-a"

    async def destroy_all() -> None:
        await asyncio.gather(*(world.manager.destroy(i) for i in ids))

    world.loop.run(destroy_all())
    assert not world.manager.networks and world.manager.pool.in_use == frozenset()
    assert wait_until(lambda: not [x for x in links(world.host) if x.startswith(PREFIX)])
    assert not [x for x in sh(["ip", "netns", "list"]).split() if x.startswith(PREFIX)]


def test_preexec_enters_the_namespace(world: World) -> None:
    import json
    import subprocess

    net, _ = world.create("pre", guest=False)
    out = subprocess.run(["ip", "-j", "link", "show"], preexec_fn=net.preexec(),
                         capture_output=True, text=True, check=True).stdout
    assert "tap0" in {link["ifname"] for link in json.loads(out)}


def test_concurrent_create_of_the_same_id(world: World) -> None:
    import asyncio

    async def both() -> list[SandboxNetwork | BaseException]:
        return list(await asyncio.gather(world.manager.create("dup"),
                                         world.manager.create("dup"), return_exceptions=True))

    results = world.loop.run(both())
    nets = [r for r in results if isinstance(r, SandboxNetwork)]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(nets) == 1 and len(errors) == 1
    assert isinstance(errors[0], SandboxNetworkExistsError)
    guest = world.attach_guest(nets[0])  # the winner is intact
    assert try_tcp(guest, INET_A, PORT) == "inet-a"


def test_concurrent_policy_updates_end_consistent(world: World) -> None:
    import asyncio

    _, guest = world.create("sbx1")
    policies = [NetworkPolicy(deny_out=(INET_A,)), NetworkPolicy(), NetworkPolicy(
        allow_internet_access=False)]

    async def race() -> None:
        await asyncio.gather(*(world.manager.update_policy("sbx1", p) for p in policies))

    world.loop.run(race())
    final = world.manager.get("sbx1").policy
    assert final == policies[-1]  # updates apply in call order
    assert try_tcp(guest, INET_A, PORT) is None
