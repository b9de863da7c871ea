"""Per-sandbox networking: a network namespace with a TAP for the VMM, NAT for egress,
a host-reachable address DNAT'ed to the guest, and egress rules (allowOut/denyOut).

    async with NetworkManager(NetworkManagerConfig()) as nm:   # NetworkUnavailableError:
        net = await nm.create("sbx1", NetworkPolicy(deny_out=("0.0.0.0/0",)))  # use slirp
        argv = net.wrap_argv(["qemu-system-x86_64", ..., *net.qemu_args()])
        cmdline = f"... {net.kernel_cmdline()}"
        host, port = net.guest_address(49983)       # what the proxy connects to
        await nm.update_policy("sbx1", NetworkPolicy())
        await nm.destroy("sbx1")                    # after the VMM exited
"""

from .errors import (
    AddressPoolExhaustedError,
    NetworkCleanupError,
    NetworkCommandError,
    NetworkError,
    NetworkPolicyError,
    NetworkUnavailableError,
    SandboxNetworkExistsError,
    SandboxNetworkNotFoundError,
)
from .manager import ExistingNetwork, NetworkManager, NetworkManagerConfig
from .policy import DEFAULT_DENIED, EgressRules, NetworkPolicy
from .pool import AddressPool, Block
from .probe import NetworkCapability, probe_capability
from .sandbox import GuestNetConfig, SandboxNetwork, qemu_netdev_args

__all__ = [
    "DEFAULT_DENIED",
    "AddressPool",
    "AddressPoolExhaustedError",
    "Block",
    "EgressRules",
    "ExistingNetwork",
    "GuestNetConfig",
    "NetworkCapability",
    "NetworkCleanupError",
    "NetworkCommandError",
    "NetworkError",
    "NetworkManager",
    "NetworkManagerConfig",
    "NetworkPolicy",
    "NetworkPolicyError",
    "NetworkUnavailableError",
    "SandboxNetwork",
    "SandboxNetworkExistsError",
    "SandboxNetworkNotFoundError",
    "probe_capability",
    "qemu_netdev_args",
]
