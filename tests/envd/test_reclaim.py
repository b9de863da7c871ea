"""envd's POST /aenv/reclaim (ours): drop the guest's clean page cache before the host
snapshots it. The drop is checked against fake procfs files here (dropping this host's
cache from a test would slow every other test), the route's token rule in
test_http_endpoints.py; a real guest's drop is checked by
tests/e2e/test_python_sdk.py's fork, whose memory diff must hold less than the file the
parent wrote and synced."""

from __future__ import annotations

from pathlib import Path

import pytest

from envd.http import reclaim


def meminfo(path: Path, free_kib: int) -> None:
    path.write_text(f"MemTotal:        1015800 kB\nMemFree:        {free_kib:8d} kB\n"
                    "MemAvailable:     800000 kB\nCached:           200000 kB\n")


def test_drop_writes_1_and_says_what_it_freed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    drop, info = tmp_path / "drop_caches", tmp_path / "meminfo"
    drop.write_text("0\n")
    meminfo(info, 100 * 1024)
    real_open = open

    def dropping_open(path, mode="r", *a, **kw):  # type: ignore[no-untyped-def]
        f = real_open(path, mode, *a, **kw)
        if str(path) == str(drop) and "w" in mode:
            meminfo(info, 350 * 1024 + 512)  # the kernel freed 250.5 MiB
        return f

    monkeypatch.setattr("builtins.open", dropping_open)
    got = reclaim.drop_clean_cache(str(drop), str(info))
    assert got == {"freedMiB": 250, "freeMiB": 350}
    assert drop.read_text() == "1\n"  # page cache only: not dentries and inodes (2, 3)


def test_nothing_freed_is_zero_not_negative(tmp_path: Path) -> None:
    drop, info = tmp_path / "drop_caches", tmp_path / "meminfo"
    meminfo(info, 100 * 1024)
    assert reclaim.drop_clean_cache(str(drop), str(info))["freedMiB"] == 0


def test_a_guest_without_procfs_answers_an_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        reclaim.drop_clean_cache(str(tmp_path / "none"), str(tmp_path / "no-meminfo"))

