"""The `aenv` click commands: thin wrappers over rest.ApiClient, envd.Envd and terminal."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import click

from .envd import Envd, shell_command
from .errors import EXIT_GENERIC, CliError
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
        return Envd(self.sandbox_url, sandbox_id, info.get("envdAccessToken"))

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


@click.group(cls=AenvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--api-url", envvar=["AENV_API_URL", "E2B_API_URL"], default=DEFAULT_API_URL,
              show_default=True, help="REST API (env AENV_API_URL, E2B_API_URL).")
@click.option("--api-key", envvar=["AENV_API_KEY", "E2B_API_KEY"], default=None,
              help="API key (env AENV_API_KEY, E2B_API_KEY; else the service's key file).")
@click.option("--sandbox-url", envvar="E2B_SANDBOX_URL", default=DEFAULT_SANDBOX_URL,
              show_default=True, help="Sandbox proxy (env E2B_SANDBOX_URL).")
@click.pass_context
def cli(ctx: click.Context, api_url: str, api_key: str | None, sandbox_url: str) -> None:
    """aenv: start and drive E2B-compatible microVM sandboxes."""
    s = Settings(api_url=api_url, api_key=api_key or key_from_file(), sandbox_url=sandbox_url,
                 key_given=bool(api_key))
    ctx.obj = s
    ctx.call_on_close(s.close)


# --- lifecycle ---------------------------------------------------------------------------

@cli.command()
@click.option("--template", "-t", default="base", show_default=True)
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=300,
              show_default=True, help="Seconds until the sandbox pauses or is killed.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Environment variable.")
@click.option("--metadata", "metadata", multiple=True, metavar="K=V")
@click.option("--no-auto-pause", is_flag=True, help="Kill (not pause) on timeout.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def start(ctx: click.Context, template: str, timeout_s: int, envs: Sequence[str],
          metadata: Sequence[str], no_auto_pause: bool, as_json: bool) -> None:
    """Start a sandbox and print its id."""
    body = {"templateID": template, "timeout": timeout_s, "envVars": pairs(envs, "--env"),
            "metadata": pairs(metadata, "--metadata"), "autoPause": not no_auto_pause}
    info = settings(ctx).api.create(body)
    if as_json:
        emit_json(info)
    else:
        click.echo(info["sandboxID"])


@cli.command("ls")
@click.option("--state", default=None, help="Comma-separated: running,paused.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx: click.Context, state: str | None, as_json: bool) -> None:
    """List sandboxes."""
    items = settings(ctx).api.list_sandboxes(state)
    if as_json:
        emit_json(items)
        return
    rows = [("SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")]
    for i in items:
        meta = ",".join(f"{k}={v}" for k, v in sorted((i.get("metadata") or {}).items()))
        rows.append((i.get("sandboxID", ""), i.get("alias") or i.get("templateID", ""),
                     i.get("state", ""), i.get("startedAt", ""), i.get("endAt", ""), meta))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


@cli.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def info(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    data = settings(ctx).api.get(sandbox_id)
    if as_json:
        emit_json(data)
        return
    for key in sorted(data):
        if key == "envdAccessToken":
            continue  # a secret: only with --json
        value = data[key]
        shown = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
        click.echo(f"{key}: {shown}")


@cli.command()
@click.argument("sandbox_id")
@click.pass_context
def kill(ctx: click.Context, sandbox_id: str) -> None:
    """Kill a sandbox."""
    settings(ctx).api.kill(sandbox_id)


@cli.command()
@click.argument("sandbox_id")
@click.option("--filesystem", is_flag=True,
              help="keep the disk only: resuming cold-boots it (processes are not kept)")
@click.pass_context
def pause(ctx: click.Context, sandbox_id: str, filesystem: bool) -> None:
    """Pause a running sandbox (memory and disk are kept, unless --filesystem)."""
    settings(ctx).api.pause(sandbox_id, memory=not filesystem)


@cli.command()
@click.argument("sandbox_id")
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=None)
@click.option("--reboot", is_flag=True,
              help="cold-boot the paused sandbox's disk instead of restoring its memory")
@click.pass_context
def resume(ctx: click.Context, sandbox_id: str, timeout_s: int | None, reboot: bool) -> None:
    """Resume a paused sandbox."""
    settings(ctx).api.resume(sandbox_id, timeout_s, memory=not reboot)


@cli.command("timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=click.IntRange(min=0))
@click.pass_context
def set_timeout(ctx: click.Context, sandbox_id: str, seconds: int) -> None:
    """Set the sandbox's remaining lifetime to SECONDS from now."""
    settings(ctx).api.set_timeout(sandbox_id, seconds)


@cli.command()
@click.argument("sandbox_id")
@click.option("-n", "count", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def fork(ctx: click.Context, sandbox_id: str, count: int, as_json: bool) -> None:
    """Fork a sandbox into N children; prints one child id per line."""
    results = settings(ctx).api.fork(sandbox_id, count)
    if as_json:
        emit_json(results)
    failed = 0
    for r in results:
        if r.get("sandbox"):
            if not as_json:
                click.echo(r["sandbox"]["sandboxID"])
        else:
            failed += 1
            err = r.get("error") or {}
            click.echo(f"aenv: fork failed: {err.get('code', '?')} {err.get('message', '')}",
                       err=True)
    if failed:
        ctx.exit(EXIT_GENERIC)


# --- snapshots ---------------------------------------------------------------------------

@cli.command()
@click.argument("sandbox_id")
@click.option("--name", default=None)
@click.pass_context
def snapshot(ctx: click.Context, sandbox_id: str, name: str | None) -> None:
    """Snapshot a sandbox; prints the snapshot id."""
    click.echo(settings(ctx).api.snapshot(sandbox_id, name)["snapshotID"])


@cli.command()
@click.option("--sandbox", "sandbox_id", default=None)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def snapshots(ctx: click.Context, sandbox_id: str | None, as_json: bool) -> None:
    """List snapshots."""
    items = settings(ctx).api.snapshots(sandbox_id)
    if as_json:
        emit_json(items)
        return
    for s in items:
        names = [n for n in s.get("names", []) if n != s["snapshotID"]]
        click.echo(s["snapshotID"] + (f"  ({', '.join(names)})" if names else ""))


@cli.command("rm-snapshot")
@click.argument("snapshot_id")
@click.pass_context
def rm_snapshot(ctx: click.Context, snapshot_id: str) -> None:
    """Delete a snapshot."""
    settings(ctx).api.delete_snapshot(snapshot_id)


# --- observability -----------------------------------------------------------------------

@cli.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def logs(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Print the sandbox's logs."""
    entries = settings(ctx).api.logs(sandbox_id)
    if as_json:
        emit_json(entries)
        return
    for e in entries:
        click.echo(f"{e.get('timestamp', '')} {e.get('level', 'info'):5} {e.get('message', '')}")


@cli.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def metrics(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Print the sandbox's resource metrics."""
    items = settings(ctx).api.metrics(sandbox_id)
    if as_json:
        emit_json(items)
        return
    click.echo("TIMESTAMP             CPUS  CPU%    MEM USED/TOTAL          DISK USED/TOTAL")
    for m in items:
        click.echo(f"{m.get('timestamp', ''):20}  {m.get('cpuCount', 0):4}  "
                   f"{m.get('cpuUsedPct', 0):5.1f}  "
                   f"{m.get('memUsed', 0):>10}/{m.get('memTotal', 0):<12} "
                   f"{m.get('diskUsed', 0):>10}/{m.get('diskTotal', 0)}")


# --- inside the sandbox ------------------------------------------------------------------

@cli.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", "-u", default=None, help="Run as this user (default: envd's).")
@click.option("--cwd", default=None)
@click.option("--env", "envs", multiple=True, metavar="K=V")
@click.pass_context
def exec_command(ctx: click.Context, sandbox_id: str, command: tuple[str, ...], user: str | None,
         cwd: str | None, envs: Sequence[str]) -> None:
    """Run COMMAND in the sandbox (`aenv exec ID -- CMD...`), exit with its exit code.

    One argument is a shell command line (`bash -l -c`); several are shell-quoted first.
    """
    env = pairs(envs, "--env")
    envd = settings(ctx).envd(sandbox_id)
    pid: list[int] = []
    try:
        result = envd.exec(shell_command(command), user=user, cwd=cwd, envs=env,
                           stdout=sys.stdout.buffer,
                           stderr=sys.stderr.buffer, on_start=pid.append)
    except KeyboardInterrupt:
        if pid:
            try:
                envd.kill_process(pid[0])
            except CliError:
                pass
        click.echo("aenv: interrupted; remote process killed", err=True)
        ctx.exit(130)
    finally:
        envd.close()
    code = result.exit_code
    if not result.exited:  # killed by a signal: say so (an exit status speaks for itself)
        click.echo(f"aenv: remote command {result.error or result.status}", err=True)
        code = code if code > 0 else EXIT_GENERIC
    ctx.exit(code if 0 <= code <= 255 else EXIT_GENERIC)


def _terminal(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
              cwd: str | None) -> None:
    from .terminal import run_terminal  # termios: POSIX only, loaded when used

    envd = settings(ctx).envd(sandbox_id)
    try:
        code = run_terminal(envd, cmd=command, user=user, cwd=cwd)
    finally:
        envd.close()
    ctx.exit(code if 0 <= code <= 255 else EXIT_GENERIC)


_terminal_options: list[Callable[[Any], Any]] = [
    click.argument("sandbox_id"),
    click.option("--cmd", "command", default=None, help="Run this instead of a login shell."),
    click.option("--user", "-u", default=None),
    click.option("--cwd", default=None),
]


def _with_terminal_options(fn: Any) -> Any:
    for deco in reversed(_terminal_options):
        fn = deco(fn)
    return fn


@cli.command()
@_with_terminal_options
@click.pass_context
def terminal(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
             cwd: str | None) -> None:
    """Open an interactive terminal in a running sandbox."""
    _terminal(ctx, sandbox_id, command, user, cwd)


@cli.command()
@_with_terminal_options
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=None)
@click.pass_context
def connect(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
            cwd: str | None, timeout_s: int | None) -> None:
    """Resume the sandbox if paused, then open an interactive terminal."""
    settings(ctx).api.connect(sandbox_id, timeout_s)
    _terminal(ctx, sandbox_id, command, user, cwd)


@cli.command()
@click.argument("sandbox_id")
@click.argument("local", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("remote")
@click.option("--user", "-u", default=None)
@click.pass_context
def upload(ctx: click.Context, sandbox_id: str, local: Path, remote: str,
           user: str | None) -> None:
    """Copy a local file into the sandbox (streamed)."""
    envd = settings(ctx).envd(sandbox_id)
    try:
        size = envd.upload(local, remote, user=user)
    finally:
        envd.close()
    click.echo(f"{local} -> {sandbox_id}:{remote} ({size} bytes)", err=True)


@cli.command()
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", type=click.Path(path_type=Path))
@click.option("--user", "-u", default=None)
@click.pass_context
def download(ctx: click.Context, sandbox_id: str, remote: str, local: Path,
             user: str | None) -> None:
    """Copy a file out of the sandbox (streamed); LOCAL may be a directory."""
    if local.is_dir():
        local = local / PurePosixPath(remote).name
    envd = settings(ctx).envd(sandbox_id)
    try:
        size = envd.download(remote, local, user=user)
    finally:
        envd.close()
    click.echo(f"{sandbox_id}:{remote} -> {local} ({size} bytes)", err=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (`aenv`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="aenv")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
