"""The fake Firecracker (and jailer, nbd-client) as the Firecracker driver tests use them.

This machine has no Firecracker binary and no usable KVM (PVM only), so every
Firecracker test runs the real driver against `fake_firecracker.py`, whose API server
checks each request against Firecracker's published OpenAPI document (v1.16.1, verbatim
in tests/vmm/data/) and simulates its documented state rules and guest memory.

Fixtures: `fake_fc` (the fake binary + what it recorded; checks that no process
outlives the test) and `spec` (a TAP VM with a read-only root and a data disk).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from host.vmm import FileDisk, TapNet, VmSpec
from host.vmm.firecracker.driver import FirecrackerDriver

from .helpers import procs_mentioning

HERE = Path(__file__).parent
FAKE = HERE / "fake_firecracker.py"
FAKE_JAILER = HERE / "fake_jailer.py"
Call = tuple[str, str, Any]


def script(path: Path, target: Path) -> Path:
    """An executable at `path` that runs the Python script `target` with our venv."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{target}" "$@"\n')
    path.chmod(0o755)
    return path


class FakeFc:
    """The fake binary plus what it recorded."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.monkeypatch = monkeypatch
        self.log = tmp / "api.jsonl"
        self.binary = script(tmp / "bin" / "firecracker", FAKE)
        self.run_dir = tmp / "run"
        self.guest = tmp / "guest-writes.json"
        monkeypatch.setenv("FAKE_FC_GUEST", str(self.guest))

    def records(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def calls(self) -> list[Call]:
        return [(r["method"], r["path"], r["body"]) for r in self.records()]

    def clear(self) -> None:
        self.log.unlink(missing_ok=True)

    def driver(self, **kw: Any) -> FirecrackerDriver:
        kw.setdefault("firecracker", str(self.binary))
        return FirecrackerDriver(run_dir=self.run_dir, **kw)

    def guest_writes(self, pages: dict[int, int]) -> None:
        """What the (fake) guest writes before it is next paused: page -> fill byte."""
        self.guest.write_text(json.dumps({str(k): v for k, v in pages.items()}))

    def assert_all_accepted(self) -> None:
        bad = [r for r in self.records() if r["status"] >= 300]
        assert not bad, bad

    def assert_nothing_left(self) -> None:
        assert procs_mentioning(str(self.tmp)) == []
        assert not self.run_dir.exists() or list(self.run_dir.iterdir()) == []


@pytest.fixture
def fake_fc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeFc]:
    """A fake `firecracker` recording to api.jsonl; checks no process outlives the test."""
    fc = FakeFc(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_FC_LOG", str(fc.log))
    for var in ("FAKE_FC_MODE", "FAKE_FC_FAIL", "FAKE_FC_CRASH", "FAKE_FC_HANG",
                "FAKE_FC_ROOT"):
        monkeypatch.delenv(var, raising=False)
    yield fc
    assert procs_mentioning(str(tmp_path)) == []


@pytest.fixture
def spec(tmp_path: Path) -> VmSpec:
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"\x7fELF fake kernel")
    root, data = tmp_path / "root.ext4", tmp_path / "data.img"
    root.write_bytes(b"root")
    data.write_bytes(b"data")
    return VmSpec(kernel=kernel, cmdline="console=ttyS0 quiet", vcpus=2, mem_mib=256,
                  disks=(FileDisk(path=root, read_only=True),
                         FileDisk(path=data, serial="data")),
                  network=TapNet(tap="tap7", guest_ip="10.11.0.2", mac="06:00:0a:0b:00:02"),
                  name="fc-test")


def boot_calls(spec: VmSpec, *, dirty: bool = True, kernel: str = "boot/vmlinux"
               ) -> list[Call]:
    return [
        ("PUT", "/machine-config", {"vcpu_count": spec.vcpus, "mem_size_mib": spec.mem_mib,
                                    "track_dirty_pages": dirty}),
        ("PUT", "/boot-source", {"kernel_image_path": kernel,
                                 "boot_args": "reboot=k panic=1 pci=off console=ttyS0 quiet"
                                              + (" page_reporting.page_reporting_order=7"
                                                 " page_reporting.page_reporting_delay_ms=20"
                                                 " sysctl.vm.percpu_pagelist_high_fraction=512"
                                                 if spec.balloon else "")}),
        ("PUT", "/drives/rootfs", {"drive_id": "rootfs", "path_on_host": "drives/rootfs",
                                   "is_root_device": True, "is_read_only": True}),
        ("PUT", "/drives/data", {"drive_id": "data", "path_on_host": "drives/data",
                                 "is_root_device": False, "is_read_only": False}),
        ("PUT", "/network-interfaces/eth0", {"iface_id": "eth0", "host_dev_name": "tap7",
                                             "guest_mac": "06:00:0a:0b:00:02"}),
        *([("PUT", "/balloon", {"amount_mib": 0, "deflate_on_oom": True,
                                "stats_polling_interval_s": 1, "free_page_reporting": True})]
          if spec.balloon else []),
        ("PUT", "/actions", {"action_type": "InstanceStart"}),
    ]
