"""The `aenv` click group, its global options, and the sandbox commands that are one REST
call each: thin wrappers over rest.ApiClient. The other commands live in their own
modules (in_sandbox.py: inside a sandbox; snapshots.py, templates.py, volumes.py, auth.py,
completion.py) and are added to the group at the end."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from . import auth, completion, gc, in_sandbox, nodes, snapshots, templates, volumes
from .errors import EXIT_GENERIC
from .invocation import (
    API_KEY_ENV,
    API_URL_ENV,
    DEFAULT_API_URL,
    DEFAULT_SANDBOX_URL,
    SANDBOX_URL_ENV,
    AenvGroup,
    pairs,
    resolve_settings,
    settings,
)
from .output import echo_fields, echo_table, emit_json, output_option, rfc3339

SANDBOX_ID = click.argument("sandbox_id", shell_complete=completion.sandbox_ids)


@click.group(cls=AenvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--api-url", envvar=list(API_URL_ENV), default=None,
              help=f"REST API (env AENV_API_URL, E2B_API_URL; else `aenv auth login`'s; "
                   f"default {DEFAULT_API_URL}).")
@click.option("--api-key", envvar=list(API_KEY_ENV), default=None,
              help="API key (env AENV_API_KEY, E2B_API_KEY; else `aenv auth login`'s, "
                   "else the service's key file).")
@click.option("--sandbox-url", envvar=list(SANDBOX_URL_ENV), default=None,
              help=f"Sandbox proxy (env E2B_SANDBOX_URL; else `aenv auth login`'s; "
                   f"default {DEFAULT_SANDBOX_URL}).")
@click.pass_context
def cli(ctx: click.Context, api_url: str | None, api_key: str | None,
        sandbox_url: str | None) -> None:
    """aenv: start and drive E2B-compatible microVM sandboxes.

    Exit codes: 0 ok, 1 error, 2 usage, 3 authentication, 4 not found, 5 conflict, 130
    interrupted; exec, terminal and connect: the remote command's.
    """
    s = resolve_settings(ctx, api_url=api_url, api_key=api_key, sandbox_url=sandbox_url)
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
@output_option
@click.pass_context
def start(ctx: click.Context, template: str, timeout_s: int, envs: Sequence[str],
          metadata: Sequence[str], no_auto_pause: bool, output: str) -> None:
    """Start a sandbox and print its id."""
    body = {"templateID": template, "timeout": timeout_s, "envVars": pairs(envs, "--env"),
            "metadata": pairs(metadata, "--metadata"), "autoPause": not no_auto_pause}
    info = settings(ctx).api.create(body)
    if output == "json":
        emit_json(info.wire())
    else:
        click.echo(info.sandbox_id)


@cli.command("ls")
@click.option("--state", default=None, help="Comma-separated: running,paused.")
@output_option
@click.pass_context
def ls(ctx: click.Context, state: str | None, output: str) -> None:
    """List sandboxes."""
    items = settings(ctx).api.list_sandboxes(state)
    if output == "json":
        emit_json([i.wire() for i in items])
        return
    rows = [("SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")]
    for i in items:
        meta = ",".join(f"{k}={v}" for k, v in sorted(i.metadata.items()))
        rows.append((i.sandbox_id, i.alias or i.template_id, i.state, rfc3339(i.started_at),
                     rfc3339(i.end_at), meta))
    echo_table(rows, style_column=2)


@cli.command()
@SANDBOX_ID
@output_option
@click.pass_context
def info(ctx: click.Context, sandbox_id: str, output: str) -> None:
    """Show one sandbox (its envd token only with -o json)."""
    data = settings(ctx).api.get(sandbox_id).wire()
    if output == "json":
        emit_json(data)
    else:
        echo_fields(data, hidden=("envdAccessToken",))


@cli.command()
@SANDBOX_ID
@click.pass_context
def kill(ctx: click.Context, sandbox_id: str) -> None:
    """Kill a sandbox."""
    settings(ctx).api.kill(sandbox_id)


@cli.command()
@SANDBOX_ID
@click.option("--filesystem", is_flag=True,
              help="keep the disk only: resuming cold-boots it (processes are not kept)")
@click.pass_context
def pause(ctx: click.Context, sandbox_id: str, filesystem: bool) -> None:
    """Pause a running sandbox (memory and disk are kept, unless --filesystem)."""
    settings(ctx).api.pause(sandbox_id, memory=not filesystem)


@cli.command()
@SANDBOX_ID
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=None)
@click.option("--reboot", is_flag=True,
              help="cold-boot the paused sandbox's disk instead of restoring its memory")
@click.pass_context
def resume(ctx: click.Context, sandbox_id: str, timeout_s: int | None, reboot: bool) -> None:
    """Resume a paused sandbox."""
    settings(ctx).api.resume(sandbox_id, timeout_s, memory=not reboot)


@cli.command("timeout")
@SANDBOX_ID
@click.argument("seconds", type=click.IntRange(min=0))
@click.pass_context
def set_timeout(ctx: click.Context, sandbox_id: str, seconds: int) -> None:
    """Set the sandbox's remaining lifetime to SECONDS from now."""
    settings(ctx).api.set_timeout(sandbox_id, seconds)


@cli.command()
@SANDBOX_ID
@click.option("-n", "count", type=click.IntRange(min=1), default=1, show_default=True)
@output_option
@click.pass_context
def fork(ctx: click.Context, sandbox_id: str, count: int, output: str) -> None:
    """Fork a sandbox into N children; prints one child id per line."""
    results = settings(ctx).api.fork(sandbox_id, count)
    if output == "json":
        emit_json([r.wire() for r in results])
    failed = 0
    for r in results:
        if r.sandbox is not None:
            if output != "json":
                click.echo(r.sandbox.sandbox_id)
        else:
            failed += 1
            what = f"{r.error.code} {r.error.message}" if r.error else "? (no error given)"
            click.echo(f"aenv: fork failed: {what}", err=True)
    if failed:
        ctx.exit(EXIT_GENERIC)


# --- observability -----------------------------------------------------------------------

@cli.command()
@SANDBOX_ID
@output_option
@click.pass_context
def logs(ctx: click.Context, sandbox_id: str, output: str) -> None:
    """Print the sandbox's logs."""
    entries = settings(ctx).api.logs(sandbox_id)
    if output == "json":
        emit_json([e.wire() for e in entries])
        return
    for e in entries:
        click.echo(f"{rfc3339(e.timestamp)} {e.level:5} {e.message}")


@cli.command()
@SANDBOX_ID
@output_option
@click.pass_context
def metrics(ctx: click.Context, sandbox_id: str, output: str) -> None:
    """Print the sandbox's resource metrics."""
    items = settings(ctx).api.metrics(sandbox_id)
    if output == "json":
        emit_json([x.wire() for x in items])
        return
    rows: list[tuple[object, ...]] = [("TIMESTAMP", "CPUS", "CPU%", "MEM USED", "MEM TOTAL",
                                       "DISK USED", "DISK TOTAL")]
    for x in items:
        rows.append((rfc3339(x.timestamp), x.cpu_count, f"{x.cpu_used_pct:.1f}", x.mem_used,
                     x.mem_total, x.disk_used, x.disk_total))
    echo_table(rows)


for _command in (*in_sandbox.COMMANDS, *snapshots.COMMANDS, *templates.COMMANDS,
                 *volumes.COMMANDS, *auth.COMMANDS, *completion.COMMANDS, *gc.COMMANDS,
                 nodes.nodes):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (`aenv`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="aenv")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
