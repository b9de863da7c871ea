"""Identifiers the orchestrator issues: sandbox ids, snapshot ids, tokens. Their syntax
is host/ids.py's, shared with the proxy, the gateway, the network and the CLI."""

from __future__ import annotations

import secrets

from host.ids import SANDBOX_ID, SNAPSHOT_NAME, new_sandbox_id, random_chars

__all__ = ["SANDBOX_ID", "SNAPSHOT_NAME", "new_envd_token", "new_runtime_snapshot_id",
           "new_sandbox_id", "new_tag", "new_traffic_token", "public_snapshot_id"]


def new_runtime_snapshot_id(kind: str) -> str:
    """A file-system-safe id for the runtime's snapshot (a directory name there)."""
    return f"{kind[0]}{random_chars(20)}"


def new_tag() -> str:
    return random_chars(8)


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
