"""`host.hostmem.KsmSwitch` (`--ksm`): starts ksmd when it is stopped and stops it again at
exit only if it was the one to start it; a host without KSM is reported, not fatal."""

from __future__ import annotations

from pathlib import Path

from host.config import parse_config
from host.hostmem import KsmSwitch


def test_starts_ksmd_and_restores_only_what_it_changed(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("0\n")
    k = KsmSwitch(tmp_path)
    assert "started ksmd" in k.enable()
    assert (tmp_path / "run").read_text() == "1\n"
    k.restore()
    assert (tmp_path / "run").read_text() == "0\n"

    (tmp_path / "run").write_text("1\n")  # an operator runs ksmd already: left alone
    k = KsmSwitch(tmp_path)
    assert "already running" in k.enable()
    k.restore()
    assert (tmp_path / "run").read_text() == "1\n"


def test_a_host_without_ksm_is_reported(tmp_path: Path) -> None:
    k = KsmSwitch(tmp_path / "absent")
    assert "KSM unavailable" in k.enable()
    k.restore()  # nothing to undo
    assert not (tmp_path / "absent").exists()


def test_config_flag_and_env(monkeypatch) -> None:
    assert parse_config([]).ksm is False
    assert parse_config(["--ksm"]).ksm is True
    monkeypatch.setenv("AENV_KSM", "1")
    assert parse_config([]).ksm is True
    assert parse_config(["--no-ksm"]).ksm is False
