"""Environment variables of executions: the sandbox-wide ones envd holds, per-run ones.

Sandbox-wide variables (set when the sandbox was created) live in envd, not in this
server's environment: each execution asks envd's `GET /envs` (with the caller's
X-Access-Token) and the context applies what changed to the kernel's environment.
Per-run `env_vars` win over sandbox-wide ones, as on E2B, and are undone after the run.
In a python kernel each key gets back the value it had before (the sandbox-wide one, or
the user's own), or is removed; the other languages cannot report their variables back
as reliably, so there, as on E2B, a key gets back its sandbox-wide value or is removed.
The kernel-side changes are small silent executions in the kernel's language
(languages.py writes them).
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import RequestError
from .languages import Language
from .models import parse_env_vars

log = logging.getLogger(__name__)

SNAPSHOT_KEY = "aenv_env_snapshot"
# envd is on loopback: never through an HTTP(S)_PROXY the sandbox's environment may set
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


async def fetch_sandbox_envs(envd_url: str, access_token: str | None,
                             timeout_s: float) -> Mapping[str, str] | None:
    """envd's sandbox-wide variables; None when envd is absent, refuses or answers junk
    (the execution then keeps the variables the context already has)."""
    return await asyncio.to_thread(_fetch, f"{envd_url}/envs", access_token, timeout_s)


def _fetch(url: str, access_token: str | None, timeout_s: float) -> Mapping[str, str] | None:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    if access_token:
        req.add_header("X-Access-Token", access_token)
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            body = resp.read()
        return parse_env_vars(json.loads(body), "envd /envs")
    except urllib.error.HTTPError as exc:
        log.warning("envd %s answered %s: sandbox env vars not applied", url, exc.code)
    except (OSError, ValueError, RequestError) as exc:
        log.debug("envd %s unavailable: %s", url, exc)
    return None


def sandbox_env_changes(applied: Mapping[str, str], current: Mapping[str, str]
                        ) -> tuple[dict[str, str], list[str]]:
    """What to set and unset in the kernel to go from `applied` to `current`."""
    to_set = {k: v for k, v in current.items() if applied.get(k) != v}
    to_unset = [k for k in applied if k not in current]
    return to_set, to_unset


def apply_code(language: Language, to_set: Mapping[str, str],
               to_unset: Iterable[str] = ()) -> str:
    """Source in `language` that sets and unsets variables in the kernel (names and values
    are embedded as literals, never interpolated as code)."""
    parts = [language.set_env(to_set) if to_set else "",
             language.unset_env(to_unset) if to_unset else ""]
    return "\n".join(p for p in parts if p)


def reset_code(language: Language, keys: Iterable[str], sandbox: Mapping[str, str]) -> str:
    """Source that gives each per-run key back its sandbox-wide value, or removes it."""
    keys = list(keys)
    return apply_code(language, {k: sandbox[k] for k in keys if k in sandbox},
                      [k for k in keys if k not in sandbox])


def snapshot_expression(keys: Iterable[str]) -> str:
    """A user expression whose value maps each key to its current value (None if unset)."""
    return f"{{k: __import__('os').environ.get(k) for k in {list(keys)!r}}}"


def parse_snapshot(reply: Mapping[str, Any] | None) -> dict[str, str | None] | None:
    """The mapping `snapshot_expression` produced, from an execute_reply; None if absent."""
    try:
        expr = reply["user_expressions"][SNAPSHOT_KEY] if reply else None
        if not expr or expr.get("status") != "ok":
            return None
        value = ast.literal_eval(expr["data"]["text/plain"])
    except (KeyError, TypeError, ValueError, SyntaxError) as exc:
        log.warning("cannot read the env snapshot from the kernel: %s", exc)
        return None
    if not isinstance(value, dict):
        return None
    return {str(k): (v if isinstance(v, str) else None) for k, v in value.items()}


def restore_code(language: Language, snapshot: Mapping[str, str | None]) -> str:
    """Source that puts every snapshotted variable back as it was."""
    return apply_code(language, {k: v for k, v in snapshot.items() if v is not None},
                      [k for k, v in snapshot.items() if v is None])
