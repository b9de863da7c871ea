"""The QEMU driver satisfies the shared driver interface; the package exports it."""

from __future__ import annotations

from pathlib import Path

from host import vmm
from host.vmm import BootTimeouts, QemuDriver, Vm, VmmDriver, VmSpec
from host.vmm.errors import VmmBootTimeout, VmmError, VmmTimeout
from host.vmm.qemu.driver import QemuVm


def test_qemu_driver_and_vm_implement_the_protocols() -> None:
    driver = QemuDriver(accel="tcg")
    assert isinstance(driver, VmmDriver)
    # Protocol isinstance() would evaluate properties (envd_address raises before start),
    # so check the class surface instead.
    members = {n for n in dir(Vm) if not n.startswith("_")} | {"__aenter__", "__aexit__"}
    missing = [n for n in members if not hasattr(QemuVm, n)]
    assert missing == []
    vm = QemuVm(driver, VmSpec(kernel=Path("/k")), BootTimeouts())
    assert vm.pid is None and vm.state.value == "created"


def test_exports() -> None:
    for name in vmm.__all__:
        assert hasattr(vmm, name), name


def test_error_tree_and_message() -> None:
    err = VmmBootTimeout("vm: envd did not answer", serial_tail="line1\nline2",
                         stderr_tail="warn")
    assert isinstance(err, VmmTimeout) and isinstance(err, VmmError)
    assert isinstance(err, TimeoutError)
    text = str(err)
    assert text.startswith("vm: envd did not answer")
    assert "--- VMM stderr (tail) ---\nwarn" in text
    assert "--- guest serial log (tail) ---\nline1\nline2" in text
    assert err.message == "vm: envd did not answer"
