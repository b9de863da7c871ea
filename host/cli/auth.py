"""`aenv auth login|status|logout`: check an API key against the service and save it with
the service's URLs (credentials.py), show which settings are in use and whether they
work, forget them."""

from __future__ import annotations

import sys
from typing import Any

import click

from . import credentials
from .credentials import Credentials
from .errors import EXIT_AUTH, ApiError, CliError, ConnectionFailed
from .invocation import LOGIN_HINT, Settings, same_url, settings
from .output import emit_json, output_option
from .rest import ApiClient


def mask(key: str | None) -> str | None:
    """A key as shown: its first 4 characters (`e2b_`), the rest hidden."""
    if not key:
        return None
    return (key[:4] if len(key) > 8 else "") + "…"


@click.group("auth")
def auth() -> None:
    """Log in to a service (save its URL and key), show, log out."""


@auth.command()
@click.option("--api-url", default=None,
              help="The service's REST API (default: the global --api-url, its env, the "
                   "saved one, http://127.0.0.1:3000).")
@click.option("--api-key", default=None,
              help="The API key (seen by `ps`: prefer --api-key-stdin).")
@click.option("--api-key-stdin", is_flag=True, help="Read the API key from stdin.")
@click.option("--sandbox-url", default=None,
              help="The service's sandbox proxy (default: as for the other commands).")
@click.pass_context
def login(ctx: click.Context, api_url: str | None, api_key: str | None, api_key_stdin: bool,
          sandbox_url: str | None) -> None:
    """Check an API key and save it for the next commands.

    The key goes, with the API and sandbox proxy URLs, to ~/.config/aenv/credentials
    ($XDG_CONFIG_HOME/aenv/credentials; mode 0600). Without --api-key or --api-key-stdin: the key the other commands would use (env
    E2B_API_KEY, the saved one, the service's key file), else a prompt on a terminal.
    A key the API refuses is not saved (exit 3).
    """
    s = settings(ctx)
    url = api_url or s.api_url
    key = _login_key(s, url, api_key, api_key_stdin)
    api = ApiClient(url, key, timeout_s=30.0)
    try:
        api.check_key()
    except ApiError as exc:
        if exc.status in (401, 403):
            exc.hint = ": nothing was saved; check the key and run `aenv auth login` again"
        raise
    except ConnectionFailed as exc:
        exc.hint = ": is the service running? (`make run`), or pass --api-url; nothing saved"
        raise
    finally:
        api.close()
    path = credentials.save(Credentials(api_url=url, api_key=key,
                                        sandbox_url=sandbox_url or s.sandbox_url))
    click.echo(f"Logged in to {url} (key {mask(key)}); saved in {path}")


def _login_key(s: Settings, url: str, api_key: str | None, from_stdin: bool) -> str:
    if api_key and from_stdin:
        raise click.UsageError("--api-key and --api-key-stdin: give one of them")
    if from_stdin:
        key = sys.stdin.readline().strip()
        if not key:
            raise click.UsageError("--api-key-stdin: stdin held no key")
        return key
    if api_key:
        return api_key
    if s.api_key and same_url(url, s.api_url):
        return s.api_key
    if sys.stdin.isatty():
        return str(click.prompt("API key", hide_input=True)).strip()
    raise CliError("no API key", EXIT_AUTH,
                   hint=": pass --api-key-stdin (or --api-key), or set E2B_API_KEY")


@auth.command()
@output_option
@click.pass_context
def status(ctx: click.Context, output: str) -> None:
    """Show the settings in use and whether the API accepts the key.

    The API URL, the sandbox proxy URL, the key (masked) and where it comes from; exit 3
    if the API rejects the key (or there is none), 1 if it cannot be reached."""
    s = settings(ctx)
    path = credentials.credentials_path()
    error: CliError | None = None
    try:
        s.api.check_key()
        state = "ok"
    except ApiError as exc:
        error = exc
        state = ("no key" if not s.api_key else "rejected") if exc.status == 401 else "error"
    except ConnectionFailed as exc:
        error, state = exc, "unreachable"
    report: dict[str, Any] = {
        "apiUrl": s.api_url, "sandboxUrl": s.sandbox_url, "apiKey": mask(s.api_key),
        "keySource": s.key_source, "credentials": str(path) if path.exists() else None,
        "status": state}
    if output == "json":
        emit_json(report)
    else:
        key = f"{report['apiKey']} (from {s.key_source})" if s.api_key else "none"
        works = {"ok": "yes", "no key": f"no, there is none: {LOGIN_HINT}",
                 "rejected": f"no, the API rejected it: {LOGIN_HINT}",
                 "unreachable": "unknown: the API cannot be reached",
                 "error": "unknown: the API answered with an error"}[state]
        for label, value in (("API URL", s.api_url), ("Sandbox URL", s.sandbox_url),
                             ("API key", key), ("Key accepted", works)):
            click.echo(f"{label + ':':13} {value}")
    if error is not None:
        raise error  # its line and exit code: 3 (401), 1 (unreachable)


@auth.command()
def logout() -> None:
    """Forget the saved credentials (remove the file)."""
    path = credentials.credentials_path()
    if credentials.remove(path):
        click.echo(f"Logged out: removed {path}")
    else:
        click.echo(f"Not logged in ({path} does not exist)")


COMMANDS = (auth,)
