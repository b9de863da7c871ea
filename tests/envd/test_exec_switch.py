"""envd starts a command as another user through the guest init's `aenv-exec` helper
(envd/services/process/switch.py, rootfs/init/init.c): the right credentials, Popen's own
errors when the program cannot run, and no descriptor or child left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from envd.services.process import switch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build aenv-init"),
]

CREDS = {"user": 1000, "group": 1000, "extra_groups": [1000, 27]}


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("init")
    subprocess.run(["gcc", "-static", "-Os", "-o", str(d / "aenv-init"),
                    str(REPO / "rootfs/init/init.c")], check=True)
    (d / "aenv-exec").symlink_to("aenv-init")
    return d / "aenv-exec"


@pytest.fixture
def use_helper(helper: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(switch, "EXEC_HELPER", str(helper))
    return helper


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_runs_as_the_user_through_the_helper(use_helper: Path) -> None:
    p = switch.popen(["sh", "-c", "id -u; id -g; id -G"], CREDS, stdout=subprocess.PIPE,
                     env={"PATH": "/usr/bin:/bin"})  # `sh` found on the child's PATH
    out = p.communicate()[0].decode().split("\n")
    assert p.args[0] == str(use_helper)  # the helper ran, not Popen's own switch
    assert p.returncode == 0
    assert out[0] == "1000" and out[1] == "1000"
    assert set(out[2].split()) == {"1000", "27"}


def test_exec_errors_are_popens_errors(use_helper: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[subprocess.Popen[bytes]] = []
    real = subprocess.Popen

    def spy(*args: object, **kw: object) -> subprocess.Popen[bytes]:
        spawned.append(real(*args, **kw))  # type: ignore[call-overload]
        return spawned[-1]

    monkeypatch.setattr(switch.subprocess, "Popen", spy)
    before = _open_fds()
    with pytest.raises(FileNotFoundError):
        switch.popen(["no-such-program-here"], CREDS, env={"PATH": "/usr/bin:/bin"})
    with pytest.raises(FileNotFoundError):
        switch.popen(["/no/such/file"], CREDS)
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(PermissionError):
        switch.popen([str(script)], CREDS)
    assert _open_fds() == before
    # not on PATH: refused before anything is spawned; the other two helpers were reaped
    assert len(spawned) == 2 and all(p.returncode == 127 for p in spawned)


def test_without_the_helper_popen_switches_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(switch, "EXEC_HELPER", "/nonexistent/aenv-exec")
    p = switch.popen(["id", "-u"], CREDS, stdout=subprocess.PIPE,
                     env={"PATH": "/usr/bin:/bin"})
    assert p.communicate()[0].strip() == b"1000" and p.args[0] == "id"
