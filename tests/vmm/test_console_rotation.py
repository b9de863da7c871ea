"""The console log's rotation (`proc.rotate_log`) and the tail read across the pair,
against a real O_APPEND writer: what QEMU's `append=on` chardev and Firecracker's stdout
are to the log."""

from __future__ import annotations

import os
from pathlib import Path

from host.vmm.proc import rotate_log, tail


def test_a_log_past_its_bound_keeps_its_newest_half_and_the_writer_goes_on(
        tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(3000):
            os.write(fd, f"line {i:05d}\n".encode())
        assert not rotate_log(log, 1 << 20)  # 33 KB: under the bound, untouched
        assert rotate_log(log, 8192)
        kept = (tmp_path / "serial.log.1").read_bytes()
        assert len(kept) == 4096 and kept.endswith(b"line 02999\n")
        assert log.stat().st_size == 0
        os.write(fd, b"after rotation\n")  # O_APPEND: at the new end, no hole
        assert log.read_bytes() == b"after rotation\n"
    finally:
        os.close(fd)
    # the tail spans the pair: the newest lines of both, oldest first
    assert tail(log, 3).splitlines() == ["line 02998", "line 02999", "after rotation"]
    assert tail(log, 1) == "after rotation"


def test_a_second_rotation_replaces_the_older_file(tmp_path: Path) -> None:
    log = tmp_path / "serial.log"
    log.write_bytes(b"a" * 10000)
    assert rotate_log(log, 4096)
    log.write_bytes(b"b" * 10000)
    assert rotate_log(log, 4096)
    assert (tmp_path / "serial.log.1").read_bytes() == b"b" * 2048
    assert not (tmp_path / "serial.log.1.tmp").exists()


def test_no_log_is_nothing_to_rotate(tmp_path: Path) -> None:
    assert not rotate_log(tmp_path / "absent.log", 10)
    assert tail(tmp_path / "absent.log") == ""
