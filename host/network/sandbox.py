"""Values describing one sandbox's network: what the VMM, the guest init and the proxy need.

Every sandbox namespace looks the same from the inside (same guest IP, gateway, MACs and
TAP name), so a guest snapshot restored or forked into another sandbox keeps a valid
network configuration and an identical QEMU command line. The host tells sandboxes apart
by their host-reachable `address`, which the namespace DNATs to the guest.

Guest kernel command line (read by the guest init; all keys optional, absent = no network):

    aenv.ip=192.168.127.2/30      address/prefixlen for the NIC (the guest's only NIC)
    aenv.gw=192.168.127.1         default gateway
    aenv.dns=8.8.8.8,1.1.1.1      comma-separated resolvers for /etc/resolv.conf
    aenv.mac=52:54:00:12:34:56    the NIC's MAC (to pick the NIC when there are several)
    aenv.mtu=1500

The init brings up `lo`, then the NIC with that address, MTU and a default route. Kernels
built with CONFIG_IP_PNP can use `GuestNetConfig.kernel_ip_arg()` (`ip=...`) instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .commands import netns_exec_argv, netns_path, netns_preexec
from .policy import NetworkPolicy

GUEST_SUBNET = "192.168.127.0/30"
GUEST_IP = "192.168.127.2"
GATEWAY_IP = "192.168.127.1"
GUEST_MAC = "52:54:00:12:34:56"
GATEWAY_MAC = "52:54:00:ae:0e:01"  # fixed, so a restored guest's ARP cache stays valid
DEFAULT_DNS = ("8.8.8.8", "1.1.1.1")
TAP_NAME = "tap0"
# the one port of the gateway address a guest may open connections to: the host's
# services for it (volume mounts, host/volumes/guestserver.py; = envd.volumes.wire.PORT)
GUEST_SERVICE_PORT = 49982
BRIDGE_NAME = "br0"
UPLINK_NAME = "eth0"  # the namespace end of the veth pair


@dataclass(frozen=True, kw_only=True)
class GuestNetConfig:
    """The guest's side: configured by the guest init from the kernel command line."""

    ip: str = GUEST_IP
    prefixlen: int = 30
    gateway: str = GATEWAY_IP
    mac: str = GUEST_MAC
    dns: tuple[str, ...] = DEFAULT_DNS
    mtu: int = 1500
    device: str = "eth0"  # the guest's interface name

    @property
    def netmask(self) -> str:
        return str(ipaddress.IPv4Network(f"0.0.0.0/{self.prefixlen}").netmask)

    def cmdline_args(self) -> str:
        """`aenv.ip=192.168.127.2/30 aenv.gw=192.168.127.1 aenv.dns=8.8.8.8,1.1.1.1
        aenv.mac=52:54:00:12:34:56 aenv.mtu=1500` for the guest init (format: module doc)."""
        parts = [f"aenv.ip={self.ip}/{self.prefixlen}", f"aenv.gw={self.gateway}"]
        if self.dns:
            parts.append(f"aenv.dns={','.join(self.dns)}")
        parts += [f"aenv.mac={self.mac}", f"aenv.mtu={self.mtu}"]
        return " ".join(parts)

    def kernel_ip_arg(self, hostname: str = "sandbox") -> str:
        """The kernel's own `ip=` form (needs CONFIG_IP_PNP in the guest kernel):
        `ip=<client>::<gw>:<netmask>:<hostname>:<dev>:off:<dns0>:<dns1>`."""
        dns = list(self.dns[:2]) + [""] * (2 - len(self.dns[:2]))
        return (
            f"ip={self.ip}::{self.gateway}:{self.netmask}:{hostname}:{self.device}:off:"
            f"{dns[0]}:{dns[1]}"
        ).rstrip(":")


def qemu_netdev_args(
    *,
    tap: str = TAP_NAME,
    mac: str = GUEST_MAC,
    netdev_id: str = "net0",
    device: str = "virtio-net-device",
) -> list[str]:
    """QEMU arguments attaching the guest NIC to `tap` (QEMU must run in the namespace).

    `device`: virtio-net-device for `-M microvm` (virtio-mmio), virtio-net-pci for pc/q35.
    """
    return [
        "-netdev", f"tap,id={netdev_id},ifname={tap},script=no,downscript=no",
        "-device", f"{device},netdev={netdev_id},mac={mac}",
    ]


@dataclass(frozen=True, kw_only=True)
class SandboxNetwork:
    """One sandbox's network, as created by `NetworkManager.create`.

    - `netns`: namespace name (`ip netns exec`), `netns_path` for setns(2).
    - `tap`: TAP device inside the namespace for the VMM.
    - `address`: host-reachable address of the guest: connections from the host to
      `address:port` arrive at `guest.ip:port` (DNAT inside the namespace).
    - `host_ip`: the host end of the veth pair (the guest sees proxy connections from it).
    - `host_ifname`: the host end's interface name; `slot`: its block in the address pool.
    """

    sandbox_id: str
    netns: str
    host_ifname: str
    slot: int
    host_ip: str
    address: str
    tap: str = TAP_NAME
    guest: GuestNetConfig = field(default_factory=GuestNetConfig)
    policy: NetworkPolicy = field(default_factory=NetworkPolicy)

    @property
    def netns_path(self) -> str:
        return netns_path(self.netns)

    def guest_address(self, port: int) -> tuple[str, int]:
        """(host, port) at which the host (proxy) reaches guest port `port`."""
        return (self.address, port)

    def qemu_args(self, *, netdev_id: str = "net0", device: str = "virtio-net-device") -> list[str]:
        return qemu_netdev_args(tap=self.tap, mac=self.guest.mac, netdev_id=netdev_id, device=device)

    def kernel_cmdline(self) -> str:
        return self.guest.cmdline_args()

    def wrap_argv(self, argv: Sequence[str]) -> list[str]:
        """argv that runs `argv` (e.g. QEMU) inside this sandbox's namespace."""
        return netns_exec_argv(self.netns, argv)

    def preexec(self) -> Callable[[], None]:
        """A subprocess `preexec_fn` entering this namespace (setns) instead of wrap_argv."""
        return netns_preexec(self.netns)
