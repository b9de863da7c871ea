"""Helpers shared by the VMM tests."""

from __future__ import annotations

import os
from pathlib import Path


def procs_mentioning(text: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
        if text in cmd:
            found.append((int(entry.name), cmd))
    return found
