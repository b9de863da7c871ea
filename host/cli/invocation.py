"""What every `aenv` command shares: the settings from the global options, the environment
and the saved credentials (and the API client they open), the error-reporting group, and
small input helpers.

Where each setting comes from, first found wins: the option (`--api-url`, `--api-key`,
`--sandbox-url`), the environment (`AENV_*`, `E2B_*`), the credentials `aenv auth login`
saved (credentials.py), then the defaults; a key last of all from the service's own key
file. The saved key goes only to the API URL it was saved for: with another `--api-url`
the saved credentials are not used.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from . import credentials
from .credentials import Credentials
from .envd import Envd
from .errors import EXIT_CONFLICT, ApiError, CliError
from .rest import ApiClient

DEFAULT_API_URL = "http://127.0.0.1:3000"
DEFAULT_SANDBOX_URL = "http://127.0.0.1:3001"
# The service keeps its keys in <state dir>/api_keys (host/config.py, host/api/auth.py);
# duplicated here so that the CLI does not import the service.
DEFAULT_STATE_DIR = "/var/lib/aenv"
API_URL_ENV = ("AENV_API_URL", "E2B_API_URL")
API_KEY_ENV = ("AENV_API_KEY", "E2B_API_KEY")
SANDBOX_URL_ENV = ("E2B_SANDBOX_URL",)
# what to do when the API refuses the key
LOGIN_HINT = "run `aenv auth login` or set E2B_API_KEY"


def service_key_path() -> Path:
    return Path(os.environ.get("AENV_STATE_DIR") or DEFAULT_STATE_DIR) / "api_keys"


def key_from_file() -> str | None:
    """The first key in the service's key file, if this user may read it."""
    try:
        text = service_key_path().read_text()
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
    # where the key came from, for messages: "--api-key", "$E2B_API_KEY", a file's path
    key_source: str | None = None
    _api: ApiClient | None = field(default=None, repr=False)

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            self._api = ApiClient(self.api_url, self.api_key)
        return self._api

    def envd(self, sandbox_id: str) -> Envd:
        """envd of a running sandbox; GET /sandboxes/{id} supplies its access token (404 ->
        exit 4) and its state (paused: exit 5, saying how to resume it)."""
        info = self.api.get(sandbox_id)
        if info.state == "paused":
            raise CliError(f"sandbox {sandbox_id} is paused", EXIT_CONFLICT,
                           hint=f": run `aenv resume {sandbox_id}` first (or `aenv connect "
                                f"{sandbox_id}` for a terminal)")
        return Envd(self.sandbox_url, sandbox_id, info.envd_access_token)

    def close(self) -> None:
        if self._api is not None:
            self._api.close()


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _source(ctx: click.Context, name: str, flag: str, envs: Iterable[str]) -> str:
    """How the option `name` was given: its flag, or the environment variable."""
    if ctx.get_parameter_source(name) is click.core.ParameterSource.ENVIRONMENT:
        for env in envs:
            if os.environ.get(env):
                return f"${env}"
    return flag


def saved_credentials(*, warn: bool = True) -> Credentials | None:
    """The saved credentials; an unreadable file is skipped with a warning (so that
    `aenv auth login` or `logout` can still replace or remove it)."""
    try:
        return credentials.load()
    except CliError as exc:
        if warn:
            click.echo(f"aenv: warning: {exc.message}, ignored: run `aenv auth login` or "
                       "`aenv auth logout`", err=True)
        return None


def resolve_settings(ctx: click.Context, *, api_url: str | None, api_key: str | None,
                     sandbox_url: str | None, warn: bool = True) -> Settings:
    """The settings, each from the first place that has it (see the module docstring)."""
    saved = saved_credentials(warn=warn)
    url = api_url or (saved.api_url if saved else DEFAULT_API_URL)
    if saved is not None and not same_url(saved.api_url, url):
        saved = None  # saved for another API: its key must not go to this one
    key: str | None
    key_source: str | None
    if api_key:
        key, key_source = api_key, _source(ctx, "api_key", "--api-key", API_KEY_ENV)
    elif saved is not None:
        key, key_source = saved.api_key, str(credentials.credentials_path())
    else:
        key = key_from_file()
        key_source = str(service_key_path()) if key else None
    proxy = sandbox_url or (saved.sandbox_url if saved else DEFAULT_SANDBOX_URL)
    return Settings(api_url=url, api_key=key, sandbox_url=proxy, key_source=key_source)


def auth_hint(s: Settings | None) -> str:
    """What to do when the API answered 401, given where the key came from."""
    if s is None or not s.key_source:
        return f": {LOGIN_HINT}"
    return f" (the key from {s.key_source}): {LOGIN_HINT}"


class AenvGroup(click.Group):
    """Expected errors leave as one line on stderr with their exit code, no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as exc:
            if isinstance(exc, ApiError) and exc.status == 401 and not exc.hint:
                exc.hint = auth_hint(ctx.obj if isinstance(ctx.obj, Settings) else None)
            click.echo(f"aenv: {exc.line()}", err=True)
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
