"""The kernel objects of one sandbox network: made, found and removed.

`build` makes a sandbox's namespace with its veth pair (the host end addressed from the
pool's /30 block), bridge and TAP; `teardown` removes them; `netns_names`, `host_links`
and `host_ifname_of` find what exists under a prefix (recovery after a crash). Pure
mechanism over `commands.py`: which networks exist and why is `manager.py`'s to know.
"""

from __future__ import annotations

import ipaddress
import os
import re

from host.ids import is_vm_name

from .commands import Namespace, netns_inode, netns_path, pids_in_netns, remove_netns, run
from .errors import NetworkCleanupError, NetworkCommandError, NetworkError
from .pool import AddressPool, Block
from .sandbox import BRIDGE_NAME, GATEWAY_MAC, TAP_NAME, UPLINK_NAME, SandboxNetwork


def host_ifname(prefix: str, slot: int) -> str:
    """The host end of the veth of pool slot `slot`."""
    return f"{prefix}{slot}"


async def build(host: Namespace, net: SandboxNetwork, block: Block, *,
                forward_on_veth: bool, tap_user: int | None) -> None:
    """The namespace, its uplink from `host`, the bridge the guest's gateway lives on and
    the TAP the VMM opens; `forward_on_veth` where forwarding is per interface."""
    await run(["ip", "netns", "add", net.netns])
    await _add_host_veth(host, net, block)
    if forward_on_veth:
        await host.sysctl_write({f"net.ipv4.conf.{net.host_ifname}.forwarding": "1"})
    ns = Namespace(net.netns)
    tap_owner = f" user {tap_user}" if tap_user is not None else ""
    guest = net.guest
    gw_prefix = ipaddress.IPv4Network(f"{guest.gateway}/{guest.prefixlen}", strict=False)
    await ns.ip_batch([
        "link set lo up",
        f"addr add {block.netns_ip}/30 dev {UPLINK_NAME}",
        f"link set {UPLINK_NAME} up",
        f"route add default via {block.host_ip} dev {UPLINK_NAME}",
        f"link add {BRIDGE_NAME} address {GATEWAY_MAC} type bridge",
        f"addr add {guest.gateway}/{gw_prefix.prefixlen} dev {BRIDGE_NAME}",
        f"link set {BRIDGE_NAME} up",
        f"tuntap add dev {TAP_NAME} mode tap{tap_owner}",
        f"link set {TAP_NAME} master {BRIDGE_NAME}",
        f"link set {TAP_NAME} up",
    ])
    await ns.sysctl_write({
        "net.ipv4.ip_forward": "1",
        "net.ipv6.conf.all.disable_ipv6": "1",
        "net.ipv6.conf.default.disable_ipv6": "1",
    })


async def _add_host_veth(host: Namespace, net: SandboxNetwork, block: Block) -> None:
    lines = [
        f"link add {net.host_ifname} type veth peer name {UPLINK_NAME} netns {net.netns}",
        f"link set {net.host_ifname} alias {net.netns}",
        f"addr add {block.host_ip}/30 dev {net.host_ifname}",
        f"link set {net.host_ifname} up",
    ]
    try:
        await host.ip_batch(lines)
    except NetworkCommandError as exc:
        # The veth of the slot's previous network, whose namespace the kernel is still
        # freeing (`teardown`): the slot is ours now, so is any link of its name.
        if "File exists" not in exc.stderr:
            raise
        await host.ip("link", "del", net.host_ifname, check=False)
        await host.ip_batch(lines)  # nothing of the first batch was applied


async def teardown(host: Namespace, prefix: str, netns: str | None,
                   host_ifname: str | None) -> None:
    """Remove the namespace's name in-process (no process spawned): once nothing is
    left inside, the kernel frees the namespace asynchronously, and with it its
    devices, the veth pair included (its eth0 end is inside; a veth's ends go
    together). Deleting the host veth here instead cost ~35 ms on the caller's path
    (a kill's answer waited for it): unregistering a device waits for RCU under the
    rtnl lock, which serialised concurrent teardowns and the creates meanwhile; the
    namespace's cleanup does that work in the kernel's own worker, in batches.

    The host veth is deleted here only when it would outlive the namespace: when
    there is no namespace (a leftover found at recovery, a half-made network) or
    processes are still inside (they keep it alive; cut them off the network). A
    host veth still going away when its slot comes round again: `_add_host_veth`.
    Checks that the name is gone and that no process is left inside."""
    ino = netns_inode(netns) if netns else None
    # before the name goes: a freed namespace's inode number can be reused
    pids = pids_in_netns(ino) if ino is not None else []
    link_left = False
    if host_ifname and (ino is None or pids):
        res = await host.ip("link", "del", host_ifname, check=False)
        # "Cannot find device": gone already; any other failure: look again below
        link_left = res.returncode != 0 and "Cannot find device" not in res.stderr
    if netns:
        remove_netns(netns)
    left: list[str] = []
    if netns and os.path.exists(netns_path(netns)):
        left.append(f"namespace {netns}")
    if link_left and host_ifname in await host_links(host, prefix):
        left.append(f"host link {host_ifname}")
    if pids:
        left.append(f"processes {', '.join(pids)} still in {netns} (it lives until they exit)")
    if left:
        raise NetworkCleanupError(f"teardown left: {'; '.join(left)}")


async def netns_names(prefix: str) -> list[str]:
    """Namespaces named `<prefix><vm name>`."""
    names = []
    for entry in await Namespace(None).ip_json("netns", "list"):
        name = entry.get("name", "")
        if name.startswith(prefix) and is_vm_name(name[len(prefix):]):
            names.append(name)
    return names


async def host_links(host: Namespace, prefix: str) -> list[str]:
    """Host veths named `<prefix><slot>`."""
    return [
        link["ifname"] for link in await host.ip_json("link", "show")
        if re.fullmatch(re.escape(prefix) + r"\d+", link.get("ifname", ""))
    ]


async def host_ifname_of(netns: str, pool: AddressPool, prefix: str) -> str | None:
    """The host veth of a namespace, from the address of its eth0."""
    if not os.path.exists(netns_path(netns)):
        return None
    try:
        links = await Namespace(netns).ip_json("-4", "addr", "show", "dev", UPLINK_NAME)
    except NetworkError:
        return None
    for link in links:
        for info in link.get("addr_info", []):
            slot = pool.slot_of(info.get("local", "0.0.0.0"))
            if slot is not None:
                return host_ifname(prefix, slot)
    return None
