"""scripts/check-kvm.sh: the per-driver table of the VM suite.

This machine has no usable KVM (PVM only) and no Firecracker binary, so the script's
real probe must report both KVM rows skipped with the reason. It never runs the VM suite
from here: the real probe runs with --dry-run (on a KVM host, the same command without
it would start the suite), and the counting is checked with a fake pytest that writes a
JUnit report.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check-kvm.sh"
HEADER = ["driver", "available?", "reason", "passed", "failed", "skipped"]

FAKE_PYTEST = """\
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_PYTEST_LOG"], "a") as f:
    f.write(json.dumps({"argv": args, "vmm": os.environ.get("AENV_VMM"),
                        "accel": os.environ.get("AENV_ACCEL")}) + "\\n")
xml = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
passed, failed, skipped = map(int, os.environ["FAKE_PYTEST_RESULT"].split())
with open(xml, "w") as f:
    f.write('<testsuites><testsuite name="pytest" tests="%d" failures="%d" errors="0" '
            'skipped="%d"/></testsuites>' % (passed + failed + skipped, failed, skipped))
sys.exit(1 if failed else 0)
"""


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, list[str]]]:
    """Run the script; (exit status, {driver: row cells}) parsed from its table."""
    proc = subprocess.run([str(SCRIPT), *args], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable,
                                            **(env or {})})
    lines = proc.stdout.strip().splitlines()
    assert [c.strip() for c in lines[0].split("|")] == HEADER, proc.stdout + proc.stderr
    assert set(lines[1]) <= {"-", "+"}
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.split("|")]
        assert len(cells) == 6, line
        rows[cells[0]] = cells[1:]
    return proc.returncode, rows


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_this_host_skips_both_kvm_drivers_and_says_why() -> None:
    status, rows = run("--dry-run")
    assert status == 0 and list(rows) == ["qemu-kvm", "firecracker", "qemu-tcg"]
    for row in rows.values():
        assert row[2:] == ["-", "-", "-"] and row[1]  # nothing ran; a reason each
    if Path("/sys/module/kvm_pvm").exists():
        assert rows["qemu-kvm"][:2] == ["no", "KVM is kvm-pvm (paravirtual guests only)"]
    if shutil.which("firecracker") is None:
        assert rows["firecracker"][:2] == ["no", "firecracker not found on PATH"]
    if shutil.which("qemu-system-x86_64"):
        assert rows["qemu-tcg"][:2] == ["yes", "not run: pass --tcg (15+ minutes)"]


def test_available_rows_run_the_vm_suite_with_their_driver(tmp_path: Path) -> None:
    fake = tmp_path / "fake_pytest.py"
    fake.write_text(FAKE_PYTEST)
    log = tmp_path / "pytest.jsonl"
    env = {"CHECK_KVM_AVAIL": "qemu-kvm\\tno\\tKVM is kvm-pvm\\n"
                              "firecracker\\tyes\\tforced for the test\\n"
                              "qemu-tcg\\tyes\\tsoftware",
           "CHECK_KVM_PYTEST": f"{sys.executable} {fake}",
           "FAKE_PYTEST_LOG": str(log), "FAKE_PYTEST_RESULT": "3 1 2"}
    status, rows = run(env=env)
    assert status == 1  # a row had failures
    assert rows["qemu-kvm"] == ["no", "KVM is kvm-pvm", "-", "-", "-"]
    assert rows["firecracker"] == ["yes", "forced for the test", "3", "1", "2"]
    assert rows["qemu-tcg"][2:] == ["-", "-", "-"]
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(c["vmm"], c["accel"]) for c in calls] == [("firecracker", None)]
    assert calls[0]["argv"][:2] == ["-m", "vm"]
    assert calls[0]["argv"][-3:] == ["tests/runtime", "tests/orchestrator", "tests/e2e"]

    log.unlink()
    status, rows = run("--tcg", "--", "-x", env={**env, "FAKE_PYTEST_RESULT": "5 0 0"})
    assert status == 0
    assert rows["qemu-tcg"] == ["yes", "software", "5", "0", "0"]
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(c["vmm"], c["accel"]) for c in calls] == [("firecracker", None), ("qemu", "tcg")]
    assert calls[1]["argv"][-1] == "-x"


def test_bad_argument_is_refused() -> None:
    proc = subprocess.run([str(SCRIPT), "--nope"], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "unknown argument --nope" in proc.stderr
