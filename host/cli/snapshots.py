"""`aenv snapshot create|ls|rm`, and the earlier spellings kept working: `aenv snapshot ID
[--name N]` (create), `aenv snapshots` (ls) and `aenv rm-snapshot` (rm), hidden from help
and completion. A snapshot is a template (deleted through DELETE /templates/{id})."""

from __future__ import annotations

import click

from host.ids import is_sandbox_id

from .invocation import settings
from .output import echo_table, emit_json, output_option

_CREATE_OPTIONS = ("--name", "-o", "--output", "--json")


class SnapshotGroup(click.Group):
    """The `snapshot` group; an argument list that is not a subcommand's but `create`'s
    (`snapshot ID [--name N]`, `snapshot --name N ID`) runs `create`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and self._is_create(args[0]):
            args = ["create", *args]
        return super().parse_args(ctx, args)

    def _is_create(self, arg: str) -> bool:
        if arg in self.commands:
            return False
        if arg.startswith("-"):
            return arg.split("=", 1)[0] in _CREATE_OPTIONS
        # a sandbox id (host/ids.py: the service issues no other), so that a mistyped
        # subcommand (`snapshot lss`) is still "No such command", not a snapshot of "lss"
        return is_sandbox_id(arg)


@click.group("snapshot", cls=SnapshotGroup)
def snapshot() -> None:
    """Create, list and delete snapshots.

    `aenv snapshot ID [--name N]` is `aenv snapshot create ID [--name N]`."""


@snapshot.command("create")
@click.argument("sandbox_id")
@click.option("--name", default=None, help="Snapshot name (default: a new id).")
@output_option
@click.pass_context
def create(ctx: click.Context, sandbox_id: str, name: str | None, output: str) -> None:
    """Snapshot a sandbox (it keeps running); prints the snapshot id."""
    snap = settings(ctx).api.snapshot(sandbox_id, name)
    if output == "json":
        emit_json(snap.wire())
    else:
        click.echo(snap.snapshot_id)


@snapshot.command("ls")
@click.option("--sandbox", "sandbox_id", default=None, help="Only this sandbox's snapshots.")
@output_option
@click.pass_context
def ls(ctx: click.Context, sandbox_id: str | None, output: str) -> None:
    """List snapshots."""
    items = settings(ctx).api.snapshots(sandbox_id)
    if output == "json":
        emit_json([s.wire() for s in items])
        return
    rows: list[tuple[str, str]] = [("SNAPSHOT ID", "NAMES")]
    for s in items:
        names = [n for n in s.names if n != s.snapshot_id]
        rows.append((s.snapshot_id, ",".join(names) or "-"))
    echo_table(rows)


@snapshot.command("rm")
@click.argument("snapshot_id")
@click.pass_context
def rm(ctx: click.Context, snapshot_id: str) -> None:
    """Delete a snapshot."""
    settings(ctx).api.delete_snapshot(snapshot_id)


def _alias(command: click.Command, name: str) -> click.Command:
    """`command` under an earlier name, hidden from help and completion."""
    return click.Command(name, params=command.params, callback=command.callback,
                         help=f"The same as `aenv snapshot {command.name}`.", hidden=True)


COMMANDS = (snapshot, _alias(ls, "snapshots"), _alias(rm, "rm-snapshot"))
