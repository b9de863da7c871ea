"""Our shell scripts run under `set -o pipefail`, where a reader that stops early fails the
script at random: the writer gets SIGPIPE (exit 141) only when it writes after the reader
is gone, which depends on output size and scheduling. CI lost a run to exactly this
(`ldconfig -p | awk '... {print; exit}'` in scripts/freeze-envd.sh). Readers in a pipe read
to the end instead (`awk '... && !found {...; found = 1}'`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# a pipe into a reader that can exit before its input ends
EARLY_EXIT = [
    (re.compile(r"\|\s*head\b"), "| head"),
    (re.compile(r"\|\s*grep\s+(-\w*q|--quiet)"), "| grep -q"),
    (re.compile(r"\|\s*awk\b[^|]*\bexit\b"), "| awk ... exit"),
    (re.compile(r"\|\s*sed\b[^|]*;\s*q\b"), "| sed ...;q"),
]


def pipefail_scripts() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.sh", ".ci/run"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    return [REPO / f for f in listed if "pipefail" in (REPO / f).read_text(errors="replace")]


def test_no_early_exit_readers_in_pipefail_scripts() -> None:
    scripts = pipefail_scripts()
    assert any(p.name == "freeze-envd.sh" for p in scripts)
    found = []
    for path in scripts:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for pattern, what in EARLY_EXIT:
                if pattern.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()}")
    assert not found, "early-exit readers under pipefail:\n" + "\n".join(found)


def test_the_check_catches_the_pattern_that_failed_ci() -> None:
    line = """LIBFUSE3="$(/sbin/ldconfig -p | awk '/libfuse3\\.so\\.3 / {print $NF; exit}')\""""
    assert any(p.search(line) for p, _ in EARLY_EXIT)
