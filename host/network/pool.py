"""The node's pool of per-sandbox /30 blocks for the host <-> namespace veth pair.

Slot i of pool 10.200.0.0/16 is 10.200.0.(4i)/30: `.1` is the host end, `.2` the namespace
end, which is also the sandbox's host-reachable address (DNAT'ed to the guest). Slots are
handed out round-robin so a freed address is not reused at once (the host may still hold
conntrack entries for it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .errors import AddressPoolExhaustedError

BLOCK_PREFIXLEN = 30


@dataclass(frozen=True)
class Block:
    """One sandbox's /30."""

    slot: int
    network: ipaddress.IPv4Network

    @property
    def host_ip(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 1

    @property
    def netns_ip(self) -> ipaddress.IPv4Address:
        return self.network.network_address + 2


class AddressPool:
    """Allocates /30 blocks out of an IPv4 CIDR. Not thread-safe: the manager serialises."""

    def __init__(self, cidr: str = "10.200.0.0/16") -> None:
        self.network = ipaddress.IPv4Network(cidr)
        if self.network.prefixlen > BLOCK_PREFIXLEN:
            raise ValueError(f"pool {cidr} is smaller than one /{BLOCK_PREFIXLEN} block")
        self.size = 2 ** (BLOCK_PREFIXLEN - self.network.prefixlen)
        self._used: set[int] = set()
        self._next = 0

    def block(self, slot: int) -> Block:
        if not 0 <= slot < self.size:
            raise ValueError(f"slot {slot} outside pool {self.network} (size {self.size})")
        base = self.network.network_address + slot * 4
        return Block(slot, ipaddress.IPv4Network(f"{base}/{BLOCK_PREFIXLEN}"))

    def slot_of(self, address: str | ipaddress.IPv4Address) -> int | None:
        """The slot whose block holds `address`, or None if it is outside the pool."""
        ip = ipaddress.IPv4Address(address)
        if ip not in self.network:
            return None
        return (int(ip) - int(self.network.network_address)) // 4

    def allocate(self) -> Block:
        for i in range(self.size):
            slot = (self._next + i) % self.size
            if slot not in self._used:
                self._used.add(slot)
                self._next = (slot + 1) % self.size
                return self.block(slot)
        raise AddressPoolExhaustedError(f"all {self.size} blocks of {self.network} are in use")

    def reserve(self, slot: int) -> Block:
        """Mark a slot used (recovery of a network that survived a restart)."""
        block = self.block(slot)
        self._used.add(slot)
        return block

    def release(self, slot: int) -> None:
        self._used.discard(slot)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)
