"""The syntax of identifiers every layer shares: sandbox ids, the wider forms some layers
must accept, snapshot names. One rule in one place (STYLE.md); a leaf module, so that
the proxy, the gateway, the API, the orchestrator, the network and the CLI may all
import it without an upward import.

    SANDBOX_ID     i + 20 of [a-z0-9]      what the service issues (`new_sandbox_id`)
    ROUTABLE_ID    [a-z0-9]+               what a request may name: a Host label's id part
                                           or E2b-Sandbox-Id (spec §1.6.1)
    VM_NAME        [A-Za-z0-9][A-Za-z0-9_.-]{0,62}
                                           what the runtime names a VM and its network
    SNAPSHOT_NAME  [team/]name[:tag]       a snapshot's public name

Each wider form contains SANDBOX_ID (tests/test_ids.py checks it), so an issued id is
accepted everywhere.
"""

from __future__ import annotations

import re
import secrets

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_CHARS = "[a-z0-9]"               # ALPHABET as a regex class
SANDBOX_ID_PREFIX = "i"
SANDBOX_ID_RANDOM = 20            # random characters after the prefix (as E2B's infra)

# The id of a sandbox this service made. Lower case and no "-": an id is one part of a
# DNS label (`<port>-<id>.<domain>`), where case is lost and "-" separates the port.
SANDBOX_ID_BODY = f"{SANDBOX_ID_PREFIX}{_CHARS}{{{SANDBOX_ID_RANDOM}}}"
SANDBOX_ID = re.compile(f"^{SANDBOX_ID_BODY}$")

# What the proxy and the gateway parse out of a request (E2B infra's own check): the
# widest id a DNS label can carry. Wider than SANDBOX_ID on purpose: a well-formed id that
# is not one of ours is answered "not found" (502, which the SDKs read as "not running"),
# only a malformed one "invalid" (400).
ROUTABLE_ID_BODY = f"{_CHARS}+"
ROUTABLE_ID = re.compile(f"^{ROUTABLE_ID_BODY}$")

# The name of a VM the runtime runs and of what it owns (network namespace `<prefix>
# <name>`, block stack): a sandbox id, or a template build's `tpl-<id>` and an image
# import's `tpl-<id>-i` (host/runtime/parts.py, imports.py). Safe as one path component
# and in `ip netns` names; the network layer checks it, not SANDBOX_ID, for those builds.
VM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

# A snapshot's public name: "<name or sandbox id>[:<tag>]", the name may carry a "team/".
SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}(:[A-Za-z0-9._-]{1,64})?$")


def random_chars(n: int) -> str:
    """`n` random characters of ALPHABET (ids, tags)."""
    return "".join(secrets.choice(ALPHABET) for _ in range(n))


def new_sandbox_id() -> str:
    """A new sandbox id: matches SANDBOX_ID (the SDKs require ^[a-z0-9]+$)."""
    return SANDBOX_ID_PREFIX + random_chars(SANDBOX_ID_RANDOM)


def is_sandbox_id(value: str) -> bool:
    """Whether `value` can be the id of a sandbox this service made."""
    return SANDBOX_ID.fullmatch(value) is not None


def is_routable_id(value: str) -> bool:
    """Whether a request may name `value` as a sandbox id (else: 400)."""
    return ROUTABLE_ID.fullmatch(value) is not None


def is_vm_name(value: str) -> bool:
    return VM_NAME.fullmatch(value) is not None
