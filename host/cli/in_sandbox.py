"""The `aenv` commands that work inside a sandbox, through envd behind the sandbox proxy:
exec, terminal, connect (resume, then terminal), upload and download (with a progress bar
on a terminal); and `terminal --web`, a link to the sandbox's browser terminal."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import click

from .completion import sandbox_ids
from .envd import shell_command
from .errors import EXIT_GENERIC, CliError
from .invocation import pairs, settings
from .output import rfc3339
from .progress import TransferProgress, is_terminal

DEFAULT_WEB_TTL_S = 900


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", shell_complete=sandbox_ids)
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

    def interrupted(signum: int, frame: Any) -> None:
        # Ctrl-C ends the CLI here rather than as a KeyboardInterrupt: raised wherever the
        # main thread was, that could land inside httpx's streaming response and its
        # connection pool, whose unwinding could then wait forever (seen under load: a
        # CLI that never exited). The kill goes on a client of its own (kill_process).
        if pid:
            with contextlib.suppress(CliError):
                envd.kill_process(pid[0])
        with contextlib.suppress(Exception):  # a write the signal cut may be mid-flush
            sys.stdout.flush()
        click.echo("aenv: interrupted; remote process killed", err=True)
        os._exit(130)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        result = envd.exec(shell_command(command), user=user, cwd=cwd, envs=env,
                           stdout=sys.stdout.buffer,
                           stderr=sys.stderr.buffer, on_start=pid.append)
    finally:
        signal.signal(signal.SIGINT, previous)
        envd.close()
    code = result.exit_code
    if not result.exited:  # killed by a signal: say so (an exit status speaks for itself)
        click.echo(f"aenv: remote command {result.error or result.status}", err=True)
        code = code if code > 0 else EXIT_GENERIC
    ctx.exit(code if 0 <= code <= 255 else EXIT_GENERIC)


def _terminal(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
              cwd: str | None) -> None:
    from .terminal import run_terminal

    envd = settings(ctx).envd(sandbox_id)
    try:
        code = run_terminal(envd, cmd=command, user=user, cwd=cwd)
    finally:
        envd.close()
    ctx.exit(code if 0 <= code <= 255 else EXIT_GENERIC)


_terminal_options: list[Callable[[Any], Any]] = [
    click.argument("sandbox_id", shell_complete=sandbox_ids),
    click.option("--cmd", "command", default=None, help="Run this instead of a login shell."),
    click.option("--user", "-u", default=None),
    click.option("--cwd", default=None),
]


def _with_terminal_options(fn: Any) -> Any:
    for deco in reversed(_terminal_options):
        fn = deco(fn)
    return fn


@click.command()
@_with_terminal_options
@click.option("--web", is_flag=True,
              help="Print a link to the sandbox's terminal in a browser instead.")
@click.option("--ttl", "ttl_s", type=click.IntRange(min=1), default=None,
              help=f"With --web: seconds the link works (default {DEFAULT_WEB_TTL_S}).")
@click.pass_context
def terminal(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
             cwd: str | None, web: bool, ttl_s: int | None) -> None:
    """Open a terminal in a running sandbox (--web: a link).

    --web prints a link to the sandbox's terminal in a browser instead, valid --ttl
    seconds (POST /sandboxes/{id}/terminal)."""
    if not web:
        if ttl_s is not None:
            raise click.UsageError("--ttl goes with --web")
        _terminal(ctx, sandbox_id, command, user, cwd)
        return
    if command or user or cwd:
        raise click.UsageError("--web: --cmd, --user and --cwd do not apply to the web terminal")
    link = settings(ctx).api.web_terminal(sandbox_id, ttl_s or DEFAULT_WEB_TTL_S)
    click.echo(link.url)
    if is_terminal(sys.stderr):
        click.echo(f"(the link works until {rfc3339(link.expires_at)})", err=True)


@click.command()
@_with_terminal_options
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=None,
              help="Seconds the sandbox then lives (default: as it was).")
@click.pass_context
def connect(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
            cwd: str | None, timeout_s: int | None) -> None:
    """Resume the sandbox if paused, then open a terminal."""
    _, resumed = settings(ctx).api.connect(sandbox_id, timeout_s)
    if resumed:
        click.echo(f"Resumed paused sandbox {sandbox_id}", err=True)
    _terminal(ctx, sandbox_id, command, user, cwd)


@click.command()
@click.argument("sandbox_id", shell_complete=sandbox_ids)
@click.argument("local", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("remote")
@click.option("--user", "-u", default=None)
@click.pass_context
def upload(ctx: click.Context, sandbox_id: str, local: Path, remote: str,
           user: str | None) -> None:
    """Copy a local file into the sandbox.

    Streamed; a progress bar and a summary line on a terminal, silent otherwise."""
    envd = settings(ctx).envd(sandbox_id)
    live = is_terminal(sys.stderr)
    try:
        with TransferProgress(f"{local.name} ↑", sys.stderr, live=live) as bar:
            size = envd.upload(local, remote, user=user, observer=bar)
    finally:
        envd.close()
    if live:
        click.echo(f"{local} -> {sandbox_id}:{remote} ({size} bytes)", err=True)


@click.command()
@click.argument("sandbox_id", shell_complete=sandbox_ids)
@click.argument("remote")
@click.argument("local", type=click.Path(path_type=Path))
@click.option("--user", "-u", default=None)
@click.pass_context
def download(ctx: click.Context, sandbox_id: str, remote: str, local: Path,
             user: str | None) -> None:
    """Copy a file out of the sandbox; LOCAL may be a directory.

    Streamed; a progress bar and a summary line on a terminal, silent otherwise."""
    if local.is_dir():
        local = local / PurePosixPath(remote).name
    envd = settings(ctx).envd(sandbox_id)
    live = is_terminal(sys.stderr)
    try:
        with TransferProgress(f"{PurePosixPath(remote).name} ↓", sys.stderr,
                              live=live) as bar:
            size = envd.download(remote, local, user=user, observer=bar)
    finally:
        envd.close()
    if live:
        click.echo(f"{sandbox_id}:{remote} -> {local} ({size} bytes)", err=True)


COMMANDS = (exec_command, terminal, connect, upload, download)
