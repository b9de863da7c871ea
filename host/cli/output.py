"""How commands print what they got: `-o table|json` (the `--output` option every listing
and info command takes), JSON on stdout, tables drawn with rich, times as the API writes
them. Messages for people (progress, summaries, errors) go to stderr, so that `-o json`
leaves only the JSON on stdout."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

F = TypeVar("F", bound=Callable[..., Any])

FORMATS = ("table", "json")
# earlier spellings still accepted: `-o text` (the template commands) is `-o table`
_ALIASES = {"text": "table"}
# a state word in a table, coloured on a terminal
STATE_STYLES = {"running": "green", "paused": "yellow", "ready": "green", "building": "cyan",
                "waiting": "cyan", "error": "red", "failed": "red", "killed": "dim"}


class OutputFormat(click.Choice[str]):
    """`table` or `json`; the old spelling `text` is taken as `table`."""

    def __init__(self) -> None:
        super().__init__(FORMATS, case_sensitive=False)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        if isinstance(value, str) and value.lower() in _ALIASES:
            value = _ALIASES[value.lower()]
        return str(super().convert(value, param, ctx))


def output_option(f: F) -> F:
    """`-o/--output table|json` as the `output` argument; `--json` (hidden, the earlier
    spelling) means `-o json`."""

    @functools.wraps(f)
    def wrapper(*args: Any, output: str, as_json: bool, **kwargs: Any) -> Any:
        return f(*args, output="json" if as_json else output, **kwargs)

    wrapper = click.option("--json", "as_json", is_flag=True, hidden=True,
                           help="The same as -o json.")(wrapper)
    wrapper = click.option("--output", "-o", type=OutputFormat(), default="table",
                           show_default=True,
                           help="table: for people; json: for programs (stdout holds only "
                                "the JSON).")(wrapper)
    return cast(F, wrapper)


def emit_json(value: Any) -> None:
    """One JSON document on stdout."""
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def echo_table(rows: Sequence[Sequence[object]], *, style_column: int | None = None) -> None:
    """Rows (the first is the header) in left-aligned columns, two spaces apart, never
    wrapped or cut (ids are copied from them). On a terminal the header is bold and the
    `style_column` (a state) coloured; piped, plain text."""
    console = Console(file=sys.stdout, width=1 << 16, highlight=False, soft_wrap=True)
    table = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, show_edge=False,
                  header_style="bold")
    for name in rows[0]:
        table.add_column(str(name), no_wrap=True)
    for row in rows[1:]:
        cells = [Text(str(v)) for v in row]
        if style_column is not None:
            cell = cells[style_column]
            cell.stylize(STATE_STYLES.get(cell.plain, ""))
        table.add_row(*cells)
    with console.capture() as capture:
        console.print(table)
    for line in capture.get().splitlines():
        click.echo(line.rstrip())


def echo_fields(data: dict[str, Any], *, hidden: Sequence[str] = ()) -> None:
    """One `key: value` line per field, sorted; lists and objects as compact JSON."""
    for key in sorted(data):
        if key in hidden:
            continue
        value = data[key]
        shown = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value
        click.echo(f"{key}: {shown}")


def rfc3339(dt: datetime) -> str:
    """A time as the API writes it (UTC as `Z`)."""
    return dt.isoformat().replace("+00:00", "Z")
