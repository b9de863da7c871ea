"""Can this host give sandboxes their own network namespace? (the fallback decision)

`probe_capability()` tries what `NetworkManager.create` needs (CAP_NET_ADMIN, `ip`, `nft`,
`sysctl`, /dev/net/tun, a throwaway namespace with a TAP and an nftables table) and says
why not if it cannot; the VMM then uses user-mode networking (slirp).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from .commands import Namespace, have_binaries, run
from .errors import NetworkError

CAP_NET_ADMIN = 12
_probe_ids = itertools.count()


@dataclass(frozen=True)
class NetworkCapability:
    available: bool
    reason: str = ""


def _has_cap_net_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << CAP_NET_ADMIN))
    except OSError:
        pass
    return os.geteuid() == 0


async def probe_capability(prefix: str = "aenv-") -> NetworkCapability:
    """Check (for real, in a throwaway namespace) that per-sandbox networking works."""
    if not _has_cap_net_admin():
        return NetworkCapability(False, "no CAP_NET_ADMIN (run as root or grant the capability)")
    missing = have_binaries("ip", "nft", "sysctl")
    if missing:
        return NetworkCapability(False, f"missing binaries: {', '.join(missing)}")
    if not os.path.exists("/dev/net/tun"):
        return NetworkCapability(False, "/dev/net/tun does not exist")
    # Not "<prefix><id>": recovery must never mistake a probe for a sandbox namespace.
    name = f"{prefix.rstrip('-_')}probe{os.getpid()}-{next(_probe_ids)}"
    try:
        await run(["ip", "netns", "add", name])
    except NetworkError as exc:
        return NetworkCapability(False, f"cannot create a network namespace: {exc}")
    try:
        ns = Namespace(name)
        await ns.ip("tuntap", "add", "dev", "tap0", "mode", "tap")
        await ns.nft("table inet probe { chain c { type filter hook forward priority 0; policy accept; }; }\n")
        await ns.sysctl_write({"net.ipv4.ip_forward": "1"})
    except NetworkError as exc:
        return NetworkCapability(False, f"namespace works but TAP/nftables/sysctl do not: {exc}")
    finally:
        await run(["ip", "netns", "del", name], check=False)
    return NetworkCapability(True, "")
