"""Host-only tests with real processes: pagemap scanning, process_vm_readv/writev capture and
inject, on helper processes that map a sparse base file MAP_PRIVATE (no VM)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from host.vmm.memsnap import (
    DiffChain,
    MemSnapError,
    capture_private,
    find_vma,
    inject_chain,
    scan_private,
    scan_private_ioctl,
    scan_private_pagemap,
    write_diff,
)
from host.vmm.memsnap.capture import file_buffer
from host.vmm.memsnap.pagemap import runs_to_indexes

from .memsnap_helpers import PAGE, Child, page_pattern


def _pages(runs: list[tuple[int, int]]) -> list[int]:
    return list(runs_to_indexes(runs))


def test_scanner_finds_exactly_the_written_pages(base_file: Path, children: list[Child]) -> None:
    c = Child(base_file)
    children.append(c)
    vma = find_vma(c.pid, base_file)
    assert vma.size == 1024 * PAGE and not vma.shared and vma.offset == 0
    assert scan_private(c.pid, vma) == []
    rng = random.Random(1)
    written = sorted(rng.sample(range(1024), 200))
    c.read(sorted(rng.sample(range(1024), 300)))  # reads never make a page private
    c.write("k", written)
    ioctl_pages = _pages(scan_private_ioctl(c.pid, vma))
    pm_pages = _pages(scan_private_pagemap(c.pid, vma))
    assert ioctl_pages == written
    assert pm_pages == written


@pytest.mark.parametrize("vec_len", [1, 2, 3, 7, 64])
def test_pagemap_scan_small_vectors_do_not_duplicate(base_file: Path, children: list[Child],
                                                     vec_len: int) -> None:
    """The walk_end quirk: a walk needing several output buffers must not repeat ranges."""
    c = Child(base_file)
    children.append(c)
    written = list(range(0, 1024, 3))  # 342 separate runs
    c.write("q", written)
    vma = find_vma(c.pid, base_file)
    assert _pages(scan_private_ioctl(c.pid, vma, vec_len=vec_len)) == written


def test_capture_matches_what_was_written(base_file: Path, children: list[Child]) -> None:
    c = Child(base_file)
    children.append(c)
    written = sorted(random.Random(2).sample(range(1024), 150)) + [1023]
    written = sorted(set(written))
    c.write("cap", written)
    for method in ("ioctl", "pagemap"):
        cap = capture_private(c.pid, find_vma(c.pid, base_file), method=method)
        assert list(cap.indexes) == written
        assert cap.mem_pages == 1024
        for n, p in enumerate(written):
            assert cap.data[n * PAGE : (n + 1) * PAGE] == page_pattern("cap", p)
    # into page cache (a pause's copy): a file nobody can see, too small at first
    spill = base_file.parent / "spill"
    cap = capture_private(c.pid, find_vma(c.pid, base_file), buffer=file_buffer(spill, 10),
                          grow=lambda n: file_buffer(spill, n))
    assert not spill.exists() and list(cap.indexes) == written
    assert all(cap.data[n * PAGE : (n + 1) * PAGE] == page_pattern("cap", p)
               for n, p in enumerate(written))
    cap.close()


def test_inject_into_another_process_reproduces_the_content(base_file: Path, children: list[Child],
                                                            tmp_path: Path) -> None:
    src, dst = Child(base_file), Child(base_file)
    children += [src, dst]
    written = sorted(random.Random(3).sample(range(1024), 400))
    src.write("inj", written)
    cap = capture_private(src.pid, find_vma(src.pid, base_file))
    diff = tmp_path / "c.diff"
    write_diff(diff, indexes=cap.indexes, data=cap.data, page_size=PAGE, mem_pages=1024,
               base_sha256=b"b" * 32, config_sha256=b"c" * 32)
    with DiffChain.open([diff]) as chain:
        n = inject_chain(dst.pid, find_vma(dst.pid, base_file), chain)
    assert n == len(written)
    assert dst.sha() == src.sha()
    # the injected pages are private (CoW copies) in the target; the base file is untouched
    assert _pages(scan_private(dst.pid, find_vma(dst.pid, base_file))) == written
    fresh = Child(base_file)
    children.append(fresh)
    assert fresh.sha() != src.sha()


def test_find_vma_errors(base_file: Path, tmp_path: Path, children: list[Child]) -> None:
    c = Child(base_file)
    children.append(c)
    with pytest.raises(MemSnapError, match="not mapped"):
        find_vma(c.pid, tmp_path / "other.mem")
    c.kill()
    with pytest.raises(MemSnapError, match="gone"):
        find_vma(c.pid, base_file)
