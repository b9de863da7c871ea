"""Progress shown while the CLI waits, drawn with rich on a terminal only.

A template build (`BuildProgress`): its log entries as they arrive (the e2b SDK's
`on_build_logs` callback). On a terminal, log lines scroll above a live status line
(spinner, elapsed time, the current step, its latest output line); anywhere else, each
entry is one plain line, without ANSI codes or redrawn lines. Debug entries are not shown.

A file transfer (`TransferProgress`): a byte bar with speed and time left on a terminal;
nothing at all anywhere else."""

from __future__ import annotations

import os
import re
import time
from datetime import datetime
from types import TracebackType
from typing import Protocol, Self, TextIO

import click
from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.spinner import Spinner
from rich.text import Text

LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
STYLES = {"warn": "yellow", "error": "bold red"}

# The runtime's step headers ("[2/5] RUN make", "CACHED [1/5] COPY a /a") ...
_STEP = re.compile(r"^(?:CACHED )?\[\d+/\d+\] ")
# ... and the other lines that begin a phase: the SDK's own, then the service's.
_PHASES = ("Requesting build", "Template created", "Uploaded ", "Skipping upload",
           "All file uploads", "Starting building", "Waiting for logs", "Waiting for the",
           "Pulling ", "Booting the build VM", "Starting: ", "Ready")


# ANSI escape sequences (CSI, OSC), then the other control characters but tab and newline
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
                      r"|[\x00-\x08\x0b-\x1f\x7f]")


class LogEntry(Protocol):
    """What the SDK passes to `on_build_logs` (e2b.LogEntry)."""

    @property
    def timestamp(self) -> datetime: ...
    @property
    def level(self) -> str: ...
    @property
    def message(self) -> str: ...


def is_headline(message: str) -> bool:
    """Does this log line begin a step or phase (shown as the status line's step)?"""
    return bool(_STEP.match(message)) or message.startswith(_PHASES)


def clean(message: str) -> str:
    """One log message as plain text: a line redrawn with carriage returns (progress
    bars in a step's output) as its last state, control characters dropped."""
    lines = [line.rsplit("\r", 1)[-1] for line in message.replace("\r\n", "\n").split("\n")]
    return _CONTROL.sub("", "\n".join(lines)).rstrip()


def elapsed(seconds: float) -> str:
    """`4.2s`, `1m05s`, `1h02m`."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class BuildProgress:
    """A context manager and the `on_build_logs` callback. `live`: the status line (for a
    terminal); else plain lines `HH:MM:SS [level: ]message`."""

    def __init__(self, stream: TextIO, *, live: bool, min_level: str = "info") -> None:
        self.stream = stream
        self.live = live
        self.min_level = LEVELS[min_level]
        self.step = "Starting"
        self.detail = ""
        self._started = time.monotonic()
        self._live: Live | None = None
        self._spinner = Spinner("dots", style="cyan")

    def __enter__(self) -> Self:
        self._started = time.monotonic()
        if self.live:
            console = Console(file=self.stream, force_terminal=True, highlight=False)
            # transient: the status line goes away when the build ends
            self._live = Live(console=console, get_renderable=self._status, transient=True,
                              refresh_per_second=8, redirect_stdout=False,
                              redirect_stderr=False)
            self._live.start(refresh=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __call__(self, entry: LogEntry) -> None:
        level = entry.level if entry.level in LEVELS else "info"
        if LEVELS[level] < self.min_level:
            return
        message = clean(entry.message)
        if is_headline(message):
            self.step, self.detail = message, ""
        elif message:
            self.detail = message.splitlines()[-1]
        when = entry.timestamp.astimezone().strftime("%H:%M:%S")
        prefix = "" if level == "info" else f"{level}: "
        if self._live is None:
            # click.echo drops ANSI codes when the stream is not a terminal
            click.echo(f"{when} {prefix}{message}", file=self.stream)
            return
        line = Text.assemble((when, "dim"), " ", (prefix + message, STYLES.get(level, "")))
        self._live.refresh()  # the status line below the printed line shows this entry
        self._live.console.print(line)

    def _status(self) -> RenderableType:
        """The live line: spinner, elapsed time, current step, its latest output line."""
        if self._live is None:
            return ""
        console = self._live.console
        line = Text.assemble(
            self._spinner.render(console.get_time()),  # type: ignore[arg-type]
            " ", (elapsed(time.monotonic() - self._started), "bold"), "  ", self.step)
        if self.detail:
            line.append("  " + self.detail, style="dim")
        line.truncate(max(console.width - 1, 20), overflow="ellipsis")
        line.no_wrap = True
        return line


class TransferProgress:
    """A byte progress bar for an upload or a download (an envd.TransferObserver), drawn
    on `stream` only when `live` (a terminal); otherwise it draws nothing at all. The bar
    goes away when the transfer ends (the command then prints one summary line)."""

    def __init__(self, description: str, stream: TextIO, *, live: bool) -> None:
        self.description = description
        self.stream = stream
        self.live = live
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Self:
        if self.live:
            console = Console(file=self.stream, force_terminal=True, highlight=False)
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                transient=True, refresh_per_second=8, redirect_stdout=False,
                redirect_stderr=False)
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def start(self, total: int | None) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(self.description, total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, n)
