"""QEMU opens the sandbox's TAP from inside the namespace (no guest boot: -S)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from host.network import NetworkPolicy

from .conftest import World
from .netns_util import sh

pytestmark = pytest.mark.timeout(120)
QEMU = "qemu-system-x86_64"


def _qmp(path: Path, command: str, **arguments: object) -> object:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        f = s.makefile("rwb")
        json.loads(f.readline())  # greeting
        for cmd, args in (("qmp_capabilities", {}), (command, arguments)):
            f.write(json.dumps({"execute": cmd, "arguments": args}).encode() + b"\n")
            f.flush()
            while "return" not in (reply := json.loads(f.readline())):
                if "error" in reply:
                    raise RuntimeError(reply["error"])
        return reply["return"]


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"qemu exited rc={proc.returncode}: {proc.stderr.read()!r}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise AssertionError("qemu QMP socket did not appear")
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which(QEMU) is None, reason=f"{QEMU} not installed")
def test_qemu_opens_tap_inside_namespace(world: World, tmp_path: Path) -> None:
    net, _ = world.create("vm1", NetworkPolicy(), guest=False)
    assert "NO-CARRIER" in sh(["ip", "-n", net.netns, "link", "show", net.tap])
    qmp = tmp_path / "qmp.sock"
    argv = net.wrap_argv([
        QEMU, "-M", "microvm", "-accel", "tcg", "-nodefaults", "-display", "none", "-S",
        "-qmp", f"unix:{qmp},server=on,wait=off", *net.qemu_args(),
    ])
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(qmp, proc)
        info = _qmp(qmp, "human-monitor-command", **{"command-line": "info network"})
        assert isinstance(info, str)
        assert "ifname=tap0" in info and net.guest.mac in info, info
        # QEMU holds the TAP open: the link now has carrier
        assert "NO-CARRIER" not in sh(["ip", "-n", net.netns, "link", "show", net.tap])
        assert str(proc.pid) in sh(["ip", "netns", "pids", net.netns]).split()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    world.loop.run(world.manager.destroy("vm1"))  # after the VMM exited: clean
