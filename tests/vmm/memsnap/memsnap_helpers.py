"""Helpers for memsnap tests: processes that map a base file MAP_PRIVATE like a share=off
QEMU (``memsnap_child.py``), and sparse base files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .memsnap_child import PAGE, page_pattern

HERE = Path(__file__).parent

__all__ = ["PAGE", "Child", "make_base", "page_pattern"]


class Child:
    """One helper process mapping ``base`` MAP_PRIVATE."""

    def __init__(self, base: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "memsnap_child.py"), str(base)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.kill()
            raise RuntimeError(f"child did not start: {line!r}")
        self.pid = self.proc.pid

    def cmd(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().strip()
        if not out or out.startswith("error"):
            raise RuntimeError(f"child {self.pid}: {line!r} -> {out!r}")
        return out

    def write(self, seed: str, pages: list[int]) -> None:
        for i in range(0, len(pages), 2000):
            self.cmd(f"write {seed} " + ",".join(map(str, pages[i : i + 2000])))

    def read(self, pages: list[int]) -> None:
        self.cmd("read " + ",".join(map(str, pages)))

    def page(self, p: int) -> bytes:
        return bytes.fromhex(self.cmd(f"page {p}"))

    def sha(self) -> str:
        return self.cmd("sha")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def make_base(path: Path, n_pages: int, data_pages: list[int]) -> Path:
    """A sparse file of ``n_pages`` with pattern data in ``data_pages`` (the rest are holes)."""
    with open(path, "wb") as f:
        f.truncate(n_pages * PAGE)
        for p in data_pages:
            f.seek(p * PAGE)
            f.write(page_pattern("base", p))
    os.chmod(path, 0o444)
    return path
