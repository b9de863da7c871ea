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
           "FAKE_PYTEST_LOG": str(log), "FAKE_PYTEST_RESULT": "3 1 2",
           # a failing firecracker row removes its verification: not this host's real one
           "AENV_CACHE": str(tmp_path / "cache")}
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


def test_a_passing_firecracker_row_marks_it_verified(tmp_path: Path) -> None:
    """The firecracker row passing marks it verified (what --vmm auto requires); failing
    removes the mark; a selection of the suite (extra pytest arguments) or nothing passed
    leaves it as it was. The stand-in binary answers --version; $AENV_CACHE is tmp_path."""
    fake = tmp_path / "fake_pytest.py"
    fake.write_text(FAKE_PYTEST)
    fc = tmp_path / "firecracker"
    fc.write_text("#!/bin/sh\necho 'Firecracker v1.16.1'\n")
    fc.chmod(0o755)
    marker = tmp_path / "cache" / "firecracker-verified"
    env = {"CHECK_KVM_AVAIL": "qemu-kvm\tno\tKVM is kvm-pvm\n"
                              "firecracker\tyes\tforced for the test",
           "CHECK_KVM_PYTEST": f"{sys.executable} {fake}",
           "FAKE_PYTEST_LOG": str(tmp_path / "pytest.jsonl"), "FAKE_PYTEST_RESULT": "4 0 1",
           "AENV_CACHE": str(tmp_path / "cache"), "AENV_FIRECRACKER": str(fc)}
    status, rows = run(env=env)
    assert status == 0 and rows["firecracker"][2:] == ["4", "0", "1"]
    doc = json.loads(marker.read_text())
    assert doc["binary"] == str(fc) and doc["version"] == "Firecracker v1.16.1"
    for args, result in ((["--", "-k", "snapshot"], "4 0 0"), ([], "0 0 3")):
        before = marker.read_text()
        assert run(*args, env={**env, "FAKE_PYTEST_RESULT": result})[0] == 0
        assert marker.read_text() == before   # neither verifies, neither unverifies
    status, _ = run(env={**env, "FAKE_PYTEST_RESULT": "3 1 0"})
    assert status == 1 and not marker.exists()
    status, _ = run("--", "-k", "snapshot", env={**env, "FAKE_PYTEST_RESULT": "4 0 0"})
    assert status == 0 and not marker.exists()


def test_bad_argument_is_refused() -> None:
    proc = subprocess.run([str(SCRIPT), "--nope"], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "unknown argument --nope" in proc.stderr
