"""The node's `NetworkManager`: one network namespace per sandbox, with TAP, NAT and rules.

Per sandbox (`create`):

    host (or `host_netns`)                      namespace <prefix><sandbox_id>
    <prefix><slot> 10.200.a.b+1/30  <-veth->  eth0 10.200.a.b+2/30 (= SandboxNetwork.address)
                                                 br0 192.168.127.1/30 (fixed MAC)
                                                   └─ tap0  <- QEMU runs here, guest .2/30
                                                 nft table inet aenv: DNAT, masquerade, egress

Node-wide (`open`): IPv4 forwarding (global `ip_forward`, or per interface when `uplinks`
is given) and the host table (sandbox isolation + masquerade of the pool). `aclose()`
destroys the networks it still holds, deletes the host table and restores forwarding if
it changed it.

`host_netns` runs the whole "host side" inside another namespace (tests do this so that
nothing touches the real host's network); None means the caller's own namespace.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Self

from host.ids import is_vm_name

from . import plumbing
from .commands import Namespace, listen_in, netns_path
from .errors import (
    NetworkCleanupError,
    NetworkError,
    NetworkUnavailableError,
    SandboxNetworkExistsError,
    SandboxNetworkNotFoundError,
)
from .policy import NetworkPolicy
from .pool import AddressPool
from .probe import NetworkCapability, probe_capability
from .ruleset import delete_table, host_allow_update, host_table, host_table_name, sandbox_table
from .sandbox import GUEST_SERVICE_PORT, GuestNetConfig, SandboxNetwork

log = logging.getLogger(__name__)

IFNAMSIZ = 15


@dataclass(frozen=True, kw_only=True)
class NetworkManagerConfig:
    """Node-level network settings."""

    pool: str = "10.200.0.0/16"
    prefix: str = "aenv-"  # namespaces <prefix><id>, host veths <prefix><slot>
    host_netns: str | None = None
    # None: set net.ipv4.ip_forward. A tuple: enable forwarding only on these uplink
    # interfaces and on each sandbox's host veth (leaves the global switch alone).
    uplinks: tuple[str, ...] | None = None
    guest: GuestNetConfig = field(default_factory=GuestNetConfig)
    tap_user: int | None = None  # owner of tap0 when QEMU does not run as root

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", self.prefix):
            raise ValueError(f"bad prefix {self.prefix!r}")
        size = AddressPool(self.pool).size
        if len(self.prefix) + len(str(size - 1)) > IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r} too long for interface names")


@dataclass(frozen=True, kw_only=True)
class ExistingNetwork:
    """A namespace or host veth with our prefix found on the system (`list_existing`)."""

    sandbox_id: str | None  # None: a host veth without its namespace
    netns: str | None
    host_ifname: str | None
    slot: int | None


class NetworkManager:
    """Creates, updates and destroys sandbox networks on this node. Async context manager."""

    def __init__(self, config: NetworkManagerConfig | None = None) -> None:
        self.config = config or NetworkManagerConfig()
        self.pool = AddressPool(self.config.pool)
        self.host = Namespace(self.config.host_netns)
        self.host_table = host_table_name(self.config.prefix)
        self._nets: dict[str, SandboxNetwork] = {}
        self._pending: set[str] = set()
        self._lock = asyncio.Lock()  # pool, pending ids, host_allow set
        self._policy_lock = asyncio.Lock()  # update_policy
        self._restore_sysctl: dict[str, str] = {}
        self._open = False
        self._host_allow: dict[str, list[ipaddress.IPv4Network]] = {}

    # -- lifecycle -----------------------------------------------------------------

    @staticmethod
    async def probe(prefix: str = "aenv-") -> NetworkCapability:
        """Whether namespaces work here; if not, the VMM should use user-mode networking."""
        return await probe_capability(prefix)

    async def open(self) -> NetworkManager:
        """Check capabilities, enable forwarding, install the host table.

        Raises NetworkUnavailableError (use user-mode networking) if namespaces cannot be
        made here."""
        if self._open:
            return self
        cap = await probe_capability(self.config.prefix)
        if not cap.available:
            raise NetworkUnavailableError(cap.reason)
        try:
            await self._enable_forwarding()
            await self.host.nft(
                host_table(name=self.host_table, ifname_prefix=self.config.prefix,
                           pool=str(self.pool.network))
            )
        except BaseException:
            await self._restore_forwarding()
            raise
        self._open = True
        return self

    async def aclose(self, *, keep_networks: bool = False) -> None:
        """Destroy every network still held (unless keep_networks, e.g. a graceful
        restart that leaves VMs running), remove the host table and restore forwarding.
        Idempotent. With keep_networks, forwarding and the host table stay too."""
        if not self._open:
            return
        errors: list[BaseException] = []
        if not keep_networks:
            for sandbox_id in list(self._nets):
                try:
                    await self.destroy(sandbox_id)
                except NetworkError as exc:
                    errors.append(exc)
            try:
                await self.host.nft(delete_table("ip", self.host_table))
            except NetworkError as exc:
                errors.append(exc)
            await self._restore_forwarding()
        self._nets.clear()
        self._open = False
        if errors:
            raise NetworkCleanupError("; ".join(str(e) for e in errors))

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- per sandbox ---------------------------------------------------------------

    @property
    def networks(self) -> Mapping[str, SandboxNetwork]:
        return dict(self._nets)

    def get(self, sandbox_id: str) -> SandboxNetwork:
        try:
            return self._nets[sandbox_id]
        except KeyError:
            raise SandboxNetworkNotFoundError(f"no network for sandbox {sandbox_id}") from None

    async def listen(self, sandbox_id: str, port: int = GUEST_SERVICE_PORT) -> socket.socket:
        """A socket listening on the guest's gateway address inside the sandbox's
        namespace: what the guest (and only it) connects to for the host's services."""
        net = self.get(sandbox_id)
        return await listen_in(net.netns, net.guest.gateway, port)

    def netns_name(self, sandbox_id: str) -> str:
        # not only sandbox ids: template builds and image imports have networks too
        # (host/ids.py VM_NAME)
        if not is_vm_name(sandbox_id):
            raise ValueError(f"invalid sandbox id {sandbox_id!r}")
        return f"{self.config.prefix}{sandbox_id}"

    def host_ifname(self, slot: int) -> str:
        return plumbing.host_ifname(self.config.prefix, slot)

    async def create(
        self, sandbox_id: str, policy: NetworkPolicy | None = None
    ) -> SandboxNetwork:
        """Build the sandbox's namespace, veth pair, bridge, TAP and rules.

        On failure nothing is left behind and the error is raised."""
        self._check_open()
        policy = policy or NetworkPolicy()
        netns = self.netns_name(sandbox_id)
        async with self._lock:
            if (sandbox_id in self._nets or sandbox_id in self._pending
                    or os.path.exists(netns_path(netns))):
                raise SandboxNetworkExistsError(f"sandbox {sandbox_id} already has {netns}")
            block = self.pool.allocate()
            self._pending.add(sandbox_id)  # a concurrent create of this id must not roll us back
        net = SandboxNetwork(
            sandbox_id=sandbox_id, netns=netns, host_ifname=self.host_ifname(block.slot),
            slot=block.slot, host_ip=str(block.host_ip), address=str(block.netns_ip),
            guest=self.config.guest, policy=policy,
        )
        try:
            await plumbing.build(self.host, net, block,
                                 forward_on_veth=self.config.uplinks is not None,
                                 tap_user=self.config.tap_user)
            await self._apply_policy(net)
        except BaseException:
            try:
                await asyncio.shield(self._teardown(net.netns, net.host_ifname))
            except NetworkError as exc:
                log.warning("rollback of %s incomplete: %s", netns, exc)
            async with self._lock:
                self.pool.release(block.slot)
                self._pending.discard(sandbox_id)
            raise
        self._nets[sandbox_id] = net
        self._pending.discard(sandbox_id)
        return net

    async def update_policy(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxNetwork:
        """Replace the egress rules atomically (PUT /network). Applies to new connections;
        established ones (and replies to inbound ones) continue."""
        # Serialised, so the rules in the kernel and the recorded policy always agree.
        async with self._policy_lock:
            net = replace(self.get(sandbox_id), policy=policy)
            await self._apply_policy(net)
            self._nets[sandbox_id] = net
        return net

    async def destroy(self, sandbox_id: str) -> None:
        """Remove the sandbox's namespace, veth pair, TAP and rules. Idempotent (also for
        ids this manager does not know: removes a leftover namespace by name).

        Call it after the VMM has exited: a process still inside the namespace keeps it
        alive, which is reported as NetworkCleanupError."""
        netns = self.netns_name(sandbox_id)
        net = self._nets.get(sandbox_id)
        ifname = net.host_ifname if net else await self._host_ifname_of(netns)
        try:
            await self._teardown(netns, ifname)
        finally:
            if net is not None:
                self._nets.pop(sandbox_id, None)
                async with self._lock:
                    self.pool.release(net.slot)
                if self._host_allow.pop(net.host_ifname, None):
                    await self._sync_host_allow()

    # -- recovery ------------------------------------------------------------------

    async def list_existing(self) -> list[ExistingNetwork]:
        """Namespaces and host veths with this manager's prefix (e.g. after a crash)."""
        prefix = self.config.prefix
        found: list[ExistingNetwork] = []
        seen_ifs: set[str] = set()
        for name in await plumbing.netns_names(prefix):
            sandbox_id = name[len(prefix):]
            ifname = await self._host_ifname_of(name)
            slot = int(ifname[len(prefix):]) if ifname else None
            if ifname:
                seen_ifs.add(ifname)
            found.append(ExistingNetwork(sandbox_id=sandbox_id, netns=name,
                                         host_ifname=ifname, slot=slot))
        for ifname in await plumbing.host_links(self.host, prefix):
            if ifname not in seen_ifs:
                found.append(ExistingNetwork(sandbox_id=None, netns=None, host_ifname=ifname,
                                             slot=int(ifname[len(prefix):])))
        return found

    async def recover(
        self, keep: Mapping[str, NetworkPolicy] | None = None
    ) -> list[SandboxNetwork]:
        """Adopt the networks of sandboxes in `keep` (re-applying their policy) and remove
        every other leftover with our prefix. Returns the adopted networks."""
        self._check_open()
        keep = keep or {}
        adopted: list[SandboxNetwork] = []
        errors: list[str] = []
        for ex in await self.list_existing():
            try:
                if (ex.sandbox_id is not None and ex.sandbox_id in keep
                        and ex.slot is not None and ex.host_ifname
                        and ex.sandbox_id not in self._nets):
                    async with self._lock:
                        block = self.pool.reserve(ex.slot)
                    net = SandboxNetwork(
                        sandbox_id=ex.sandbox_id, netns=ex.netns or "",
                        host_ifname=ex.host_ifname, slot=ex.slot, host_ip=str(block.host_ip),
                        address=str(block.netns_ip), guest=self.config.guest,
                        policy=keep[ex.sandbox_id],
                    )
                    await self._apply_policy(net)
                    self._nets[net.sandbox_id] = net
                    adopted.append(net)
                elif ex.sandbox_id is None or ex.sandbox_id not in self._nets:
                    await self._teardown(ex.netns, ex.host_ifname)
            except NetworkError as exc:
                errors.append(str(exc))
        if errors:
            raise NetworkCleanupError("; ".join(errors))
        return adopted

    # -- internals -----------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._open:
            raise NetworkError("NetworkManager is not open (call open() or use async with)")

    async def _apply_policy(self, net: SandboxNetwork) -> None:
        host_addrs = await self._host_addresses()
        rules = net.policy.rules(extra_denied=[self.pool.network, *host_addrs])
        subnet = ipaddress.IPv4Network(f"{net.guest.ip}/{net.guest.prefixlen}", strict=False)
        await Namespace(net.netns).nft(sandbox_table(
            address=net.address, guest_ip=net.guest.ip, guest_subnet=str(subnet), rules=rules,
        ))
        opened = [h for h in host_addrs
                  if any(h.subnet_of(a) for a in rules.allow_special)]
        if opened or self._host_allow.get(net.host_ifname):
            self._host_allow[net.host_ifname] = opened
            await self._sync_host_allow()
        if rules.unenforced:
            log.info("sandbox %s: egress entries not enforced (domain/IPv6): %s",
                     net.sandbox_id, ", ".join(rules.unenforced))

    async def _sync_host_allow(self) -> None:
        async with self._lock:
            elements = [(ifname, a) for ifname, addrs in self._host_allow.items() for a in addrs]
            await self.host.nft(host_allow_update(self.host_table, elements))

    async def _host_addresses(self) -> list[ipaddress.IPv4Network]:
        out: list[ipaddress.IPv4Network] = []
        for link in await self.host.ip_json("-4", "addr", "show"):
            for info in link.get("addr_info", []):
                if info.get("family") == "inet" and "local" in info:
                    out.append(ipaddress.IPv4Network(info["local"]))
        return out

    async def _teardown(self, netns: str | None, host_ifname: str | None) -> None:
        await plumbing.teardown(self.host, self.config.prefix, netns, host_ifname)

    async def _host_ifname_of(self, netns: str) -> str | None:
        return await plumbing.host_ifname_of(netns, self.pool, self.config.prefix)

    async def _enable_forwarding(self) -> None:
        keys = (["net.ipv4.ip_forward"] if self.config.uplinks is None
                else [f"net.ipv4.conf.{u}.forwarding" for u in self.config.uplinks])
        for key in keys:
            prior = await self.host.sysctl_read(key)
            if prior != "1":
                await self.host.sysctl_write({key: "1"})
                self._restore_sysctl[key] = prior

    async def _restore_forwarding(self) -> None:
        for key, prior in list(self._restore_sysctl.items()):
            try:
                await self.host.sysctl_write({key: prior})
            except NetworkError as exc:  # e.g. the uplink went away
                log.warning("could not restore %s=%s: %s", key, prior, exc)
            self._restore_sysctl.pop(key, None)
