"""The `aenv` click group and its REST commands: thin wrappers over rest.ApiClient; the
commands inside a sandbox (envd) are in guest.py."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import click

from . import guest, templates
from .context import (
    DEFAULT_API_URL,
    DEFAULT_SANDBOX_URL,
    AenvGroup,
    Settings,
    echo_table,
    emit_json,
    key_from_file,
    pairs,
    rfc3339,
    settings,
)
from .errors import EXIT_GENERIC


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
        emit_json(info.wire())
    else:
        click.echo(info.sandbox_id)


@cli.command("ls")
@click.option("--state", default=None, help="Comma-separated: running,paused.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx: click.Context, state: str | None, as_json: bool) -> None:
    """List sandboxes."""
    items = settings(ctx).api.list_sandboxes(state)
    if as_json:
        emit_json([i.wire() for i in items])
        return
    rows = [("SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")]
    for i in items:
        meta = ",".join(f"{k}={v}" for k, v in sorted(i.metadata.items()))
        rows.append((i.sandbox_id, i.alias or i.template_id, i.state, rfc3339(i.started_at),
                     rfc3339(i.end_at), meta))
    echo_table(rows)


@cli.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def info(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Show one sandbox."""
    data = settings(ctx).api.get(sandbox_id).wire()
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
        emit_json([r.wire() for r in results])
    failed = 0
    for r in results:
        if r.sandbox is not None:
            if not as_json:
                click.echo(r.sandbox.sandbox_id)
        else:
            failed += 1
            what = f"{r.error.code} {r.error.message}" if r.error else "? (no error given)"
            click.echo(f"aenv: fork failed: {what}", err=True)
    if failed:
        ctx.exit(EXIT_GENERIC)


# --- snapshots ---------------------------------------------------------------------------

@cli.command()
@click.argument("sandbox_id")
@click.option("--name", default=None)
@click.pass_context
def snapshot(ctx: click.Context, sandbox_id: str, name: str | None) -> None:
    """Snapshot a sandbox; prints the snapshot id."""
    click.echo(settings(ctx).api.snapshot(sandbox_id, name).snapshot_id)


@cli.command()
@click.option("--sandbox", "sandbox_id", default=None)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def snapshots(ctx: click.Context, sandbox_id: str | None, as_json: bool) -> None:
    """List snapshots."""
    items = settings(ctx).api.snapshots(sandbox_id)
    if as_json:
        emit_json([s.wire() for s in items])
        return
    for s in items:
        names = [n for n in s.names if n != s.snapshot_id]
        click.echo(s.snapshot_id + (f"  ({', '.join(names)})" if names else ""))


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
        emit_json([e.wire() for e in entries])
        return
    for e in entries:
        click.echo(f"{rfc3339(e.timestamp)} {e.level:5} {e.message}")


@cli.command()
@click.argument("sandbox_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def metrics(ctx: click.Context, sandbox_id: str, as_json: bool) -> None:
    """Print the sandbox's resource metrics."""
    items = settings(ctx).api.metrics(sandbox_id)
    if as_json:
        emit_json([x.wire() for x in items])
        return
    click.echo("TIMESTAMP             CPUS  CPU%    MEM USED/TOTAL          DISK USED/TOTAL")
    for x in items:
        click.echo(f"{rfc3339(x.timestamp):20}  {x.cpu_count:4}  {x.cpu_used_pct:5.1f}  "
                   f"{x.mem_used:>10}/{x.mem_total:<12} {x.disk_used:>10}/{x.disk_total}")


for _command in (*guest.COMMANDS, *templates.COMMANDS):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (`aenv`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="aenv")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
