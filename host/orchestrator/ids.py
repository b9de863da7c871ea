"""Identifiers the orchestrator issues: sandbox ids, snapshot ids, tokens."""

from __future__ import annotations

import re
import secrets
import string

_ALNUM = string.ascii_lowercase + string.digits
SANDBOX_ID = re.compile(r"^i[a-z0-9]{20}$")
# Public snapshot ids ("<name or sandbox id>:<tag>", may carry a "team/" prefix).
SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}(:[A-Za-z0-9._-]{1,64})?$")


def _rand(n: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


def new_sandbox_id() -> str:
    """"i" + 20 chars of [a-z0-9] (the SDKs require ^[a-z0-9]+$)."""
    return "i" + _rand(20)


def new_runtime_snapshot_id(kind: str) -> str:
    """A file-system-safe id for the runtime's snapshot (a directory name there)."""
    return f"{kind[0]}{_rand(20)}"


def new_tag() -> str:
    return _rand(8)


def new_envd_token() -> str:
    return secrets.token_urlsafe(32)


def new_traffic_token() -> str:
    return secrets.token_urlsafe(24)


def public_snapshot_id(name: str | None, sandbox_id: str) -> str:
    """The id shown to users: "<name>:<tag>" ("default" tag when a name has none), or
    "<sandbox id>:<random tag>" for an unnamed snapshot."""
    if not name:
        return f"{sandbox_id}:{new_tag()}"
    if not SNAPSHOT_NAME.match(name):
        raise ValueError(f"invalid snapshot name {name!r}")
    return name if ":" in name else f"{name}:default"
