"""`aenv gc [--dry-run]`: one run of the node's collector (POST /admin/gc), or a count of
what it would remove; prints, per kind, files and bytes removed and what the node holds."""

from __future__ import annotations

import click

from .invocation import settings
from .output import echo_table, emit_json, output_option

_KINDS = ("layers", "repository_layers", "memory", "repository_memory", "build_cache",
          "copy_archives")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@click.command("gc")
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
@output_option
@click.pass_context
def gc(ctx: click.Context, dry_run: bool, output: str) -> None:
    """Collect what the node holds and nothing needs: killed sandboxes' records past their
    retention, snapshots nothing reaches, disk layers and memory files."""
    report = settings(ctx).api.collect_garbage(dry_run=dry_run)
    if output == "json":
        emit_json(report.wire())
        return
    verb = "would remove" if dry_run else "removed"
    rows: list[tuple[object, ...]] = [("KIND", verb.upper(), "BYTES", "HELD")]
    held = report.storage.get("held") or {}
    for kind in _KINDS:
        swept = report.storage.get(kind)
        if swept is not None:
            rows.append((kind, swept["files"], _mib(swept["bytes"]), _mib(held.get(kind, 0))))
    for kind, n in report.records.items():
        rows.append((f"{kind} (records)", n, "", ""))
    echo_table(rows)
    waiting = report.storage.get("waiting_layers")
    if waiting:  # a shared repository: other nodes must show them unused first
        click.echo(f"{waiting} unreferenced layers wait for other nodes' holdings "
                   "(a later run takes them)")
    click.echo(f"{'dry run' if dry_run else 'collected'} in {report.seconds:.2f}s")


COMMANDS = (gc,)
