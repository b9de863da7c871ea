"""The `aenv` commands that work inside a sandbox, through envd behind the sandbox proxy:
exec, terminal, connect (resume, then terminal), upload and download."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import click

from .context import pairs, settings
from .envd import shell_command
from .errors import EXIT_GENERIC, CliError


@click.command("exec", context_settings={"ignore_unknown_options": True})
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


@click.command()
@_with_terminal_options
@click.pass_context
def terminal(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
             cwd: str | None) -> None:
    """Open an interactive terminal in a running sandbox."""
    _terminal(ctx, sandbox_id, command, user, cwd)


@click.command()
@_with_terminal_options
@click.option("--timeout", "timeout_s", type=click.IntRange(min=0), default=None)
@click.pass_context
def connect(ctx: click.Context, sandbox_id: str, command: str | None, user: str | None,
            cwd: str | None, timeout_s: int | None) -> None:
    """Resume the sandbox if paused, then open an interactive terminal."""
    settings(ctx).api.connect(sandbox_id, timeout_s)
    _terminal(ctx, sandbox_id, command, user, cwd)


@click.command()
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


@click.command()
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


COMMANDS = (exec_command, terminal, connect, upload, download)
