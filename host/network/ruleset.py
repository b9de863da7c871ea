"""nftables scripts: the per-sandbox table (inside its namespace) and the node's host table.

Pure text rendering, applied with `nft -f -` so each script is one atomic transaction.

Inside a sandbox namespace (`table inet aenv`):
- prerouting: new connections from the host to the sandbox address are DNAT'ed to the guest;
- postrouting: guest egress is masqueraded to the namespace's veth address;
- forward (policy drop): replies (ct established,related) always pass; host -> guest only
  when DNAT'ed; guest -> uplink goes through `egress`; IPv6 is dropped;
- egress: allow_special accept, special reject, allow accept, deny reject, accept;
- input: the guest may ping its gateway and connect to the host's service port on it
  (volume mounts), nothing else addressed to the namespace itself.

Host side (`table ip <prefix>host`): sandboxes may not reach each other nor (new
connections) the host itself, nothing from outside may open connections into a sandbox,
and the pool is masqueraded on its way out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from .policy import EgressRules
from .sandbox import BRIDGE_NAME, GATEWAY_IP, GUEST_SERVICE_PORT, UPLINK_NAME

SANDBOX_TABLE = "aenv"
REJECT = "reject with icmpx type admin-prohibited"  # inet tables
REJECT_IP = "reject with icmp type admin-prohibited"  # ip tables


def _elements(nets: Iterable[ipaddress.IPv4Network]) -> str:
    items = [str(n.network_address) if n.prefixlen == 32 else str(n) for n in nets]
    return f" elements = {{ {', '.join(items)} }};" if items else ""


def _set(name: str, nets: Iterable[ipaddress.IPv4Network]) -> str:
    return f"\tset {name} {{ type ipv4_addr; flags interval;{_elements(nets)} }}\n"


def sandbox_table(
    *, address: str, guest_ip: str, guest_subnet: str, rules: EgressRules
) -> str:
    """The whole per-namespace table, replacing any previous version atomically."""
    up, br = UPLINK_NAME, BRIDGE_NAME
    return (
        f"table inet {SANDBOX_TABLE}\n"
        f"delete table inet {SANDBOX_TABLE}\n"
        f"table inet {SANDBOX_TABLE} {{\n"
        + _set("allow_special", rules.allow_special)
        + _set("special", rules.special)
        + _set("allow", rules.allow)
        + _set("deny", rules.deny)
        + "\tchain prerouting {\n"
        "\t\ttype nat hook prerouting priority dstnat; policy accept;\n"
        f'\t\tiifname "{up}" ip daddr {address} dnat ip to {guest_ip}\n'
        "\t}\n"
        "\tchain postrouting {\n"
        "\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
        f'\t\toifname "{up}" ip saddr {guest_subnet} masquerade\n'
        "\t}\n"
        "\tchain input {\n"
        "\t\ttype filter hook input priority filter; policy accept;\n"
        f'\t\tiifname "{br}" ct state established,related accept\n'
        f'\t\tiifname "{br}" icmp type echo-request accept\n'
        f'\t\tiifname "{br}" ip daddr {GATEWAY_IP} tcp dport {GUEST_SERVICE_PORT} accept\n'
        f'\t\tiifname "{br}" drop\n'
        "\t}\n"
        "\tchain forward {\n"
        "\t\ttype filter hook forward priority filter; policy drop;\n"
        "\t\tct state established,related accept\n"
        "\t\tct state invalid drop\n"
        "\t\tmeta nfproto ipv6 drop\n"
        f'\t\tiifname "{up}" oifname "{br}" ct status dnat accept\n'
        f'\t\tiifname "{br}" oifname "{up}" jump egress\n'
        "\t}\n"
        "\tchain egress {\n"
        f"\t\tip daddr @allow_special accept\n"
        f"\t\tip daddr @special {REJECT}\n"
        f"\t\tip daddr @allow accept\n"
        f"\t\tip daddr @deny {REJECT}\n"
        "\t\taccept\n"
        "\t}\n"
        "}\n"
    )


def host_table_name(prefix: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in prefix) + "host"


def host_table(*, name: str, ifname_prefix: str, pool: str) -> str:
    """The node-level table; `ifname_prefix*` matches every sandbox's host veth."""
    wild = f'"{ifname_prefix}*"'
    return (
        f"table ip {name}\n"
        f"delete table ip {name}\n"
        f"table ip {name} {{\n"
        "\tset host_allow { type ifname . ipv4_addr; flags interval; }\n"
        "\tchain input {\n"
        "\t\ttype filter hook input priority filter; policy accept;\n"
        f"\t\tiifname {wild} ct state established,related accept\n"
        f"\t\tiifname {wild} iifname . ip daddr @host_allow accept\n"
        f"\t\tiifname {wild} {REJECT_IP}\n"
        "\t}\n"
        "\tchain forward {\n"
        "\t\ttype filter hook forward priority filter; policy accept;\n"
        f"\t\tiifname {wild} oifname {wild} {REJECT_IP}\n"
        f"\t\toifname {wild} ct state established,related accept\n"
        f"\t\toifname {wild} drop\n"
        "\t}\n"
        "\tchain postrouting {\n"
        "\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
        f"\t\tip saddr {pool} oifname != {wild} masquerade\n"
        "\t}\n"
        "}\n"
    )


def host_allow_update(name: str, elements: Iterable[tuple[str, ipaddress.IPv4Network]]) -> str:
    """Replace the host_allow set: (sandbox host ifname, host address) pairs a sandbox's
    allowOut explicitly opened."""
    items = [f'"{ifname}" . {net}' for ifname, net in elements]
    script = f"flush set ip {name} host_allow\n"
    if items:
        script += f"add element ip {name} host_allow {{ {', '.join(items)} }}\n"
    return script


def delete_table(family: str, name: str) -> str:
    return f"table {family} {name}\ndelete table {family} {name}\n"
