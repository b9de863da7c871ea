"""Driver choice."""

from __future__ import annotations

import pytest

from host.vmm import VmmError
from host.vmm.fake import FakeDriver
from host.vmm.pick import pick_driver
from host.vmm.qemu import QemuDriver


def test_explicit_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_VMM", raising=False)
    assert isinstance(pick_driver("qemu", accel="tcg"), QemuDriver)
    assert isinstance(pick_driver("fake"), FakeDriver)
    monkeypatch.setenv("AENV_VMM", "fake")
    assert isinstance(pick_driver(), FakeDriver)
    with pytest.raises(VmmError, match="unknown"):
        pick_driver("vbox")


def test_default_is_qemu_without_firecracker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_VMM", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert isinstance(pick_driver(), QemuDriver)
