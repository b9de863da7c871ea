"""What every `aenv` command shares: the settings from the global options (and the API
client they open), the error-reporting group, and small input/output helpers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from .envd import Envd
from .errors import CliError
from .rest import ApiClient

DEFAULT_API_URL = "http://127.0.0.1:3000"
DEFAULT_SANDBOX_URL = "http://127.0.0.1:3001"
# The service keeps its keys in <state dir>/api_keys (host/config.py, host/api/auth.py);
# duplicated here so that the CLI does not import the service.
DEFAULT_STATE_DIR = "/var/lib/aenv"


def key_from_file() -> str | None:
    """The first key in the service's key file, if this user may read it."""
    path = Path(os.environ.get("AENV_STATE_DIR") or DEFAULT_STATE_DIR) / "api_keys"
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    return None


@dataclass
class Settings:
    api_url: str
    api_key: str | None
    sandbox_url: str
    key_given: bool = False
    _api: ApiClient | None = field(default=None, repr=False)

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            self._api = ApiClient(self.api_url, self.api_key)
        return self._api

    def envd(self, sandbox_id: str) -> Envd:
        """envd of a sandbox; GET /sandboxes/{id} supplies its access token (404 -> exit 4)."""
        info = self.api.get(sandbox_id)
        return Envd(self.sandbox_url, sandbox_id, info.envd_access_token)

    def close(self) -> None:
        if self._api is not None:
            self._api.close()


class AenvGroup(click.Group):
    """Expected errors leave as one line on stderr with their exit code, no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as exc:
            message = exc.message
            given = isinstance(ctx.obj, Settings) and ctx.obj.key_given
            if getattr(exc, "status", None) == 401 and not given:
                message += " (pass --api-key or set AENV_API_KEY)"
            click.echo(f"aenv: {message}", err=True)
            ctx.exit(exc.exit_code)


def pairs(values: Iterable[str], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=what)
        out[key] = value
    return out


def settings(ctx: click.Context) -> Settings:
    return ctx.find_object(Settings)  # type: ignore[return-value]


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def echo_table(rows: Sequence[Sequence[object]]) -> None:
    """Rows (the first is the header) in left-aligned columns, two spaces apart."""
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


def rfc3339(dt: datetime) -> str:
    """A time as the API writes it (UTC as `Z`)."""
    return dt.isoformat().replace("+00:00", "Z")
