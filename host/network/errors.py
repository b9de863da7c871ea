"""Errors raised by host/network.

    NetworkError                        anything the network layer could not do
    ├── NetworkUnavailableError         namespaces/TAP/nftables cannot be used here: fall back
    │                                   to user-mode networking (see `probe_capability`)
    ├── NetworkCommandError             an `ip`/`nft`/`sysctl` command failed (argv, rc, stderr)
    ├── NetworkPolicyError (+ValueError)  an allowOut/denyOut entry is not valid
    ├── AddressPoolExhaustedError       no free per-sandbox address block left
    ├── SandboxNetworkExistsError       create() for a sandbox that already has a network
    ├── SandboxNetworkNotFoundError (+KeyError)  update_policy() for an unknown sandbox
    └── NetworkCleanupError             teardown ran but something is still there

Foreign errors (`OSError`, `FileNotFoundError`, `subprocess` failures, timeouts) are
translated in `commands.py` with `raise ... from exc`.
"""

from __future__ import annotations

from collections.abc import Sequence


class NetworkError(Exception):
    """A host/network operation failed."""


class NetworkUnavailableError(NetworkError):
    """This host cannot give sandboxes their own namespace; use user-mode networking."""


class NetworkCommandError(NetworkError):
    """A command (`ip`, `nft`, `sysctl`) exited non-zero or could not be run."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip() or "(no stderr)"
        super().__init__(f"{' '.join(self.argv)!s} failed (rc={returncode}): {detail}")


class NetworkPolicyError(NetworkError, ValueError):
    """An egress rule (allowOut/denyOut entry) is malformed."""


class AddressPoolExhaustedError(NetworkError):
    """Every per-sandbox address block in the pool is in use."""


class SandboxNetworkExistsError(NetworkError):
    """The sandbox already has a network (or a leftover namespace with its name)."""


class SandboxNetworkNotFoundError(NetworkError, KeyError):
    """No network is known for this sandbox id."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NetworkCleanupError(NetworkError):
    """Teardown finished but left something behind (listed in the message)."""
