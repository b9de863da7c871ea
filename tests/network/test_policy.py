"""Policy parsing, rule resolution and rendering, the address pool and the guest/QEMU
values. Pure Python: runs anywhere, no root."""

from __future__ import annotations

import ipaddress

import pytest

from host.network import (
    AddressPool,
    AddressPoolExhaustedError,
    GuestNetConfig,
    NetworkManagerConfig,
    NetworkPolicy,
    NetworkPolicyError,
    SandboxNetwork,
    qemu_netdev_args,
)
from host.network.ruleset import host_allow_update, host_table, host_table_name, sandbox_table

POOL = "10.200.0.0/16"


def rules(policy: NetworkPolicy, *extra: str):  # type: ignore[no-untyped-def]
    return policy.rules(extra_denied=[POOL, *extra])


@pytest.mark.parametrize("entry", ["", "  ", "1.2.3.4/33", "300.1.1.1", "not a host", "a..b", "-x.com", "x.123"])
def test_bad_entries_are_rejected(entry: str) -> None:
    with pytest.raises(NetworkPolicyError):
        NetworkPolicy(allow_out=(entry,))
    with pytest.raises(ValueError):  # NetworkPolicyError is a ValueError too
        NetworkPolicy(deny_out=(entry,))


def test_domains_allowed_in_allow_out_only_and_reported_unenforced() -> None:
    p = NetworkPolicy(allow_out=["example.com", "*.Example.org", "2001:db8::/32", "1.2.3.4"])  # type: ignore[arg-type]
    assert p.allow_out == ("example.com", "*.Example.org", "2001:db8::/32", "1.2.3.4")
    r = rules(p)
    assert r.unenforced == ("example.com", "*.Example.org", "2001:db8::/32")
    assert r.allow == (ipaddress.IPv4Network("1.2.3.4/32"),)
    with pytest.raises(NetworkPolicyError, match="denyOut"):
        NetworkPolicy(deny_out=("example.com",))
    hash(p)  # frozen and hashable


CASES = [
    # (policy, address, allowed?)
    (NetworkPolicy(), "93.184.216.34", True),
    (NetworkPolicy(), "10.1.2.3", False),
    (NetworkPolicy(), "172.20.0.1", False),
    (NetworkPolicy(), "192.168.1.1", False),
    (NetworkPolicy(), "100.64.0.1", False),
    (NetworkPolicy(), "169.254.169.254", False),
    (NetworkPolicy(), "127.0.0.1", False),
    (NetworkPolicy(), "224.0.0.1", False),
    (NetworkPolicy(), "255.255.255.255", False),
    (NetworkPolicy(), "203.0.113.7", False),  # a host address (extra_denied below)
    (NetworkPolicy(allow_internet_access=False), "93.184.216.34", False),
    (NetworkPolicy(deny_out=("93.184.216.0/24",)), "93.184.216.34", False),
    (NetworkPolicy(deny_out=("93.184.216.0/24",)), "93.184.217.1", True),
    (NetworkPolicy(deny_out=("0.0.0.0/0",), allow_out=("93.184.216.34",)), "93.184.216.34", True),
    (NetworkPolicy(deny_out=("0.0.0.0/0",), allow_out=("93.184.216.34",)), "93.184.216.35", False),
    (NetworkPolicy(allow_internet_access=False, allow_out=("8.8.8.0/24",)), "8.8.8.8", True),
    (NetworkPolicy(allow_out=("10.1.0.0/16",)), "10.1.2.3", True),
    (NetworkPolicy(allow_out=("10.1.0.0/16",)), "10.2.0.1", False),
    (NetworkPolicy(allow_out=("0.0.0.0/0",)), "10.1.2.3", False),  # broad allow: public only
    (NetworkPolicy(allow_out=("169.254.169.254",)), "169.254.169.254", True),
    (NetworkPolicy(allow_out=("203.0.113.7",)), "203.0.113.7", True),
    (NetworkPolicy(allow_internet_access=False, allow_out=("10.0.0.0/8",)), "10.9.9.9", True),
    (NetworkPolicy(), "2001:db8::1", False),  # no IPv6 egress
]


@pytest.mark.parametrize(("policy", "address", "allowed"), CASES)
def test_verdicts(policy: NetworkPolicy, address: str, allowed: bool) -> None:
    assert rules(policy, "203.0.113.7/32").verdict(address) is allowed


def test_sets_are_collapsed_so_nft_accepts_them() -> None:
    r = rules(NetworkPolicy(deny_out=("1.2.3.0/25", "1.2.3.128/25", "1.2.3.4")))
    assert r.deny == (ipaddress.IPv4Network("1.2.3.0/24"),)
    # the pool lies inside 10/8: collapsed into it, no overlapping interval
    assert ipaddress.IPv4Network("10.0.0.0/8") in r.special
    assert all(not a.overlaps(b) for a in r.special for b in r.special if a is not b)


def test_sandbox_table_rendering() -> None:
    r = rules(NetworkPolicy(deny_out=("1.2.3.4", "5.6.0.0/16")))
    text = sandbox_table(address="10.200.0.2", guest_ip="192.168.127.2",
                         guest_subnet="192.168.127.0/30", rules=r)
    # atomic replacement: create-if-missing, delete, define, all in one script
    assert text.startswith("table inet aenv\ndelete table inet aenv\ntable inet aenv {\n")
    assert "elements = { 1.2.3.4, 5.6.0.0/16 };" in text
    assert "set allow { type ipv4_addr; flags interval; }" in text  # empty set: no elements
    assert 'iifname "eth0" ip daddr 10.200.0.2 dnat ip to 192.168.127.2' in text
    assert 'oifname "eth0" ip saddr 192.168.127.0/30 masquerade' in text
    assert "ct state established,related accept" in text
    order = [text.index(f"ip daddr @{s} ") for s in ("allow_special", "special", "allow", "deny")]
    assert order == sorted(order)


def test_host_table_rendering() -> None:
    assert host_table_name("aenv-") == "aenv_host"
    text = host_table(name="aenv_host", ifname_prefix="aenv-", pool=POOL)
    assert 'iifname "aenv-*" oifname "aenv-*" reject' in text
    assert f'ip saddr {POOL} oifname != "aenv-*" masquerade' in text
    upd = host_allow_update("aenv_host", [("aenv-3", ipaddress.IPv4Network("203.0.113.7/32"))])
    assert upd == ("flush set ip aenv_host host_allow\n"
                   'add element ip aenv_host host_allow { "aenv-3" . 203.0.113.7/32 }\n')
    assert host_allow_update("t", []) == "flush set ip t host_allow\n"


def test_pool_blocks_round_robin_and_exhaustion() -> None:
    pool = AddressPool("10.200.0.0/29")  # two /30 blocks
    a = pool.allocate()
    assert (a.slot, str(a.host_ip), str(a.netns_ip)) == (0, "10.200.0.1", "10.200.0.2")
    b = pool.allocate()
    assert (b.slot, str(b.network)) == (1, "10.200.0.4/30")
    with pytest.raises(AddressPoolExhaustedError):
        pool.allocate()
    pool.release(0)
    assert pool.allocate().slot == 0
    assert pool.slot_of("10.200.0.6") == 1 and pool.slot_of("10.201.0.1") is None
    pool.release(1)
    assert pool.reserve(1).slot == 1 and pool.in_use == frozenset({0, 1})
    with pytest.raises(ValueError):
        pool.block(2)
    with pytest.raises(ValueError):
        AddressPool("10.0.0.0/31")


def test_config_validation() -> None:
    assert AddressPool(POOL).size == 16384
    NetworkManagerConfig(prefix="aenv-")
    with pytest.raises(ValueError, match="too long"):
        NetworkManagerConfig(prefix="averyverylong-")
    with pytest.raises(ValueError, match="bad prefix"):
        NetworkManagerConfig(prefix="a b")


def test_guest_cmdline_and_qemu_args() -> None:
    g = GuestNetConfig()
    assert g.cmdline_args() == (
        "aenv.ip=192.168.127.2/30 aenv.gw=192.168.127.1 aenv.dns=8.8.8.8,1.1.1.1 "
        "aenv.mac=52:54:00:12:34:56 aenv.mtu=1500"
    )
    assert g.kernel_ip_arg() == (
        "ip=192.168.127.2::192.168.127.1:255.255.255.252:sandbox:eth0:off:8.8.8.8:1.1.1.1"
    )
    assert GuestNetConfig(dns=()).kernel_ip_arg() == (
        "ip=192.168.127.2::192.168.127.1:255.255.255.252:sandbox:eth0:off"
    )
    assert qemu_netdev_args() == [
        "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no",
        "-device", "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56",
    ]
    net = SandboxNetwork(sandbox_id="x", netns="aenv-x", host_ifname="aenv-0", slot=0,
                         host_ip="10.200.0.1", address="10.200.0.2")
    assert net.wrap_argv(["qemu", "-S"]) == ["ip", "netns", "exec", "aenv-x", "qemu", "-S"]
    assert net.netns_path == "/run/netns/aenv-x"
    assert net.guest_address(49983) == ("10.200.0.2", 49983)
    assert net.qemu_args(device="virtio-net-pci")[-1].startswith("virtio-net-pci,")
    assert net.kernel_cmdline() == g.cmdline_args()
