"""NbdDisk -> /dev/nbdN attachment (host/vmm/firecracker/blockdev.py) against a fake sysfs and a
fake `nbd-client` (tests/vmm/fake_nbd_client.py).

This host has no nbd kernel module (`ls /sys/module | grep nbd` finds nothing) and no
nbd-client, so no test here attaches a real device: they check the module detection,
the messages, the nbd-client command lines and the device bookkeeping. Unverified here:
a real nbd-client connecting to our block server's socket.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from host.vmm import NbdDisk, VmmError
from host.vmm.firecracker.blockdev import NbdAttacher

from .fakefc import HERE, script


class FakeNbd:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch, *, modules: tuple[str, ...]
                 = ("nbd",), devices: int = 3) -> None:
        self.sys = tmp / "sys"
        self.dev = tmp / "dev"
        self.log = tmp / "nbd.jsonl"
        self.client = script(tmp / "bin" / "nbd-client", HERE / "fake_nbd_client.py")
        self.modprobe = tmp / "bin" / "modprobe"
        self.modprobe.write_text("#!/bin/sh\necho \"modprobe: FATAL: Module $1 not found\"\n"
                                 "exit 1\n")
        self.modprobe.chmod(0o755)
        for m in modules:
            (self.sys / "module" / m).mkdir(parents=True)
        self.dev.mkdir()
        for i in range(devices):
            d = self.sys / "block" / f"nbd{i}"
            d.mkdir(parents=True)
            (d / "size").write_text("0\n")
            (self.dev / f"nbd{i}").touch()
        self.socket = tmp / "nbd.sock"
        self.socket.touch()
        monkeypatch.setenv("FAKE_NBD_SYS", str(self.sys))
        monkeypatch.setenv("FAKE_NBD_LOG", str(self.log))
        monkeypatch.delenv("FAKE_NBD_BUSY", raising=False)

    def attacher(self) -> NbdAttacher:
        return NbdAttacher(nbd_client=str(self.client), modprobe=str(self.modprobe),
                           sys_root=self.sys, dev_root=self.dev)

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def nbd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNbd:
    return FakeNbd(tmp_path, monkeypatch)


async def test_attach_connects_the_first_free_device_and_detach_frees_it(
        nbd: FakeNbd, monkeypatch: pytest.MonkeyPatch) -> None:
    (nbd.sys / "block/nbd0/pid").write_text("1\n")  # taken by someone else
    monkeypatch.setenv("FAKE_NBD_BUSY", "nbd1")  # taken between our look and the connect
    att = nbd.attacher()
    assert (await att.check()).note == "using NBD"
    disk = NbdDisk(socket=nbd.socket, export="sbx-1-root", read_only=True)
    dev = await att.attach(disk)
    assert dev == nbd.dev / "nbd2"
    assert nbd.calls() == [
        [*att.argv(disk, nbd.dev / "nbd1")[1:]],
        ["-unix", str(nbd.socket), "-N", "sbx-1-root", "-b", "4096", "-readonly",
         str(nbd.dev / "nbd2")],
    ]
    await att.detach(dev)
    assert nbd.calls()[-1] == ["-d", str(nbd.dev / "nbd2")]
    assert not (nbd.sys / "block/nbd2/pid").exists()
    await att.detach(dev)  # not connected any more: no-op
    assert len(nbd.calls()) == 3


async def test_attach_without_a_free_device_or_socket_says_why(nbd: FakeNbd) -> None:
    att = nbd.attacher()
    with pytest.raises(VmmError, match=r"Socket failed.*No such file"):
        await att.attach(NbdDisk(socket=nbd.socket.with_name("gone.sock"), export="x"))
    for i in range(3):
        (nbd.sys / f"block/nbd{i}/pid").write_text("1\n")
    with pytest.raises(VmmError, match="no free /dev/nbdN"):
        await att.attach(NbdDisk(socket=nbd.socket, export="x"))


@pytest.mark.parametrize(("modules", "message"), [
    ((), (r"neither ublk_drv nor the nbd kernel module is available \(modprobe nbd: "
          r"modprobe: FATAL: Module nbd not found\)")),
    (("ublk_drv",), ("ublk_drv is loaded but our block server has no ublk server, and the "
                     "nbd kernel module is available")),
])
async def test_no_usable_kernel_module_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: tuple[str, ...],
        message: str) -> None:
    nbd = FakeNbd(tmp_path, monkeypatch, modules=modules)
    with pytest.raises(VmmError, match=message):
        await nbd.attacher().check()


async def test_ublk_without_a_ublk_server_falls_back_to_nbd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    nbd = FakeNbd(tmp_path, monkeypatch, modules=("nbd", "ublk_drv"))
    with caplog.at_level("INFO", logger="host.vmm.firecracker.blockdev"):
        found = await nbd.attacher().check()
    assert found.kind == "nbd"
    assert found.note == "ublk_drv present but no ublk server: using NBD"
    assert found.note in caplog.text


async def test_modprobe_that_loads_nbd_is_enough(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    nbd = FakeNbd(tmp_path, monkeypatch, modules=())
    nbd.modprobe.write_text(f"#!/bin/sh\nmkdir -p {nbd.sys}/module/$1\n")
    assert (await nbd.attacher().check()).kind == "nbd"


async def test_missing_nbd_client_is_named(nbd: FakeNbd) -> None:
    att = NbdAttacher(nbd_client=str(nbd.client.with_name("nope")), sys_root=nbd.sys,
                      dev_root=nbd.dev)
    with pytest.raises(VmmError, match="not installed.*nbd-client"):
        await att.check()
