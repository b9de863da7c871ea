"""Egress policy of one sandbox: what the guest may connect to.

E2B semantics (spec/e2b-compat.md §3.3): `allow_internet_access=False` equals
`denyOut=["0.0.0.0/0"]`; `allowOut` wins over `denyOut`. On top of that, private ranges,
link-local (incl. the cloud metadata address 169.254.169.254), loopback, multicast,
reserved space, the sandbox address pool and the host's own addresses are denied by
default. An `allowOut` entry opens that "special" space only when it lies entirely inside
it (`10.1.2.3` or `10.0.0.0/8` open that part; `0.0.0.0/0` opens only public space).

Domain names in `allowOut` (`example.com`, `*.example.com`) cannot be enforced by IP-level
filtering: the REST API refuses them; one in an older record is kept, not enforced
(`EgressRules.unenforced` lists them). IPv6 entries are accepted and kept as well;
sandboxes have no IPv6 egress at all.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import NetworkPolicyError

IPv4Net = ipaddress.IPv4Network

DEFAULT_DENIED: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # RFC 1918
    "100.64.0.0/10",  # carrier-grade NAT
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, incl. 169.254.169.254 (cloud metadata)
    "172.16.0.0/12",  # RFC 1918
    "192.0.0.0/24",  # IETF protocol assignments
    "192.168.0.0/16",  # RFC 1918
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved + broadcast
)
"""IPv4 ranges a guest may not reach unless an allowOut entry inside them says so."""

ALL_IPV4 = "0.0.0.0/0"

# Labels of letters, digits and inner hyphens; the last label (TLD) must hold a letter,
# so "300.1.1.1" is a bad IP, not a domain.
_DOMAIN = re.compile(
    r"^(\*\.)?(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*"
    r"(?=[a-z0-9-]*[a-z])[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    re.IGNORECASE,
)


@dataclass(frozen=True, kw_only=True)
class NetworkPolicy:
    """The egress configuration of one sandbox (POST /sandboxes, PUT /network)."""

    allow_internet_access: bool = True
    allow_out: tuple[str, ...] = ()  # CIDR / IP / domain
    deny_out: tuple[str, ...] = ()  # CIDR / IP

    def __post_init__(self) -> None:
        # Coerce lists to tuples (frozen + hashable) and validate early, at the boundary.
        object.__setattr__(self, "allow_out", tuple(self.allow_out))
        object.__setattr__(self, "deny_out", tuple(self.deny_out))
        for entry in self.allow_out:
            _parse_entry(entry, allow_domain=True, field="allowOut")
        for entry in self.deny_out:
            _parse_entry(entry, allow_domain=False, field="denyOut")

    def rules(
        self, *, extra_denied: Iterable[str | IPv4Net] = ()
    ) -> EgressRules:
        """Resolve to the address sets the firewall uses.

        `extra_denied`: addresses denied by default besides `DEFAULT_DENIED` (the host's own
        addresses, the sandbox address pool).
        """
        allow: list[IPv4Net] = []
        unenforced: list[str] = []
        for entry in self.allow_out:
            net = _parse_entry(entry, allow_domain=True, field="allowOut")
            if isinstance(net, IPv4Net):
                allow.append(net)
            else:
                unenforced.append(entry)
        deny: list[IPv4Net] = []
        for entry in self.deny_out:
            net = _parse_entry(entry, allow_domain=False, field="denyOut")
            if isinstance(net, IPv4Net):
                deny.append(net)
            else:
                unenforced.append(entry)
        if not self.allow_internet_access:
            deny = [IPv4Net(ALL_IPV4)]
        special = _collapse(
            [IPv4Net(n) for n in DEFAULT_DENIED]
            + [n if isinstance(n, IPv4Net) else IPv4Net(n, strict=False) for n in extra_denied]
        )
        allow_special = [a for a in allow if any(a.subnet_of(s) for s in special)]
        return EgressRules(
            allow=_collapse(allow),
            allow_special=_collapse(allow_special),
            special=special,
            deny=_collapse(deny),
            unenforced=tuple(unenforced),
        )


@dataclass(frozen=True, kw_only=True)
class EgressRules:
    """Address sets in evaluation order: allow_special, special (deny), allow, deny, accept."""

    allow: tuple[IPv4Net, ...]
    allow_special: tuple[IPv4Net, ...]
    special: tuple[IPv4Net, ...]
    deny: tuple[IPv4Net, ...]
    unenforced: tuple[str, ...]

    def verdict(self, address: str) -> bool:
        """True if a new connection from the guest to `address` is allowed (mirrors the
        nftables egress chain; used by tests and by callers that explain decisions)."""
        ip = ipaddress.ip_address(address)
        if not isinstance(ip, ipaddress.IPv4Address):
            return False
        if any(ip in n for n in self.allow_special):
            return True
        if any(ip in n for n in self.special):
            return False
        if any(ip in n for n in self.allow):
            return True
        return not any(ip in n for n in self.deny)


def _parse_entry(
    entry: str, *, allow_domain: bool, field: str
) -> IPv4Net | ipaddress.IPv6Network | str:
    if not isinstance(entry, str) or not entry.strip():
        raise NetworkPolicyError(f"{field}: empty or non-string entry {entry!r}")
    text = entry.strip()
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    if allow_domain and _DOMAIN.match(text):
        return text.lower()
    what = "an IP, CIDR or domain" if allow_domain else "an IP or CIDR"
    raise NetworkPolicyError(f"{field}: {entry!r} is not {what}")


def _collapse(nets: Iterable[IPv4Net]) -> tuple[IPv4Net, ...]:
    return tuple(ipaddress.collapse_addresses(nets))
