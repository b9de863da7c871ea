"""The diff file format, chains, compaction and content deltas (no processes)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import struct
import time
import zlib
from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host.vmm.memsnap import (
    CorruptSnapshotError,
    DiffChain,
    DiffFile,
    DiffKind,
    MemSnapError,
    SnapshotMismatchError,
    compact,
    delta_pages,
    write_cumulative,
    write_delta,
    write_diff,
)

PS = 4096
BASE = hashlib.sha256(b"base").digest()
CONF = hashlib.sha256(b"conf").digest()


def page(tag: int) -> bytes:
    return hashlib.sha256(str(tag).encode()).digest() * (PS // 32)


def write(path: Path, pages: dict[int, bytes], mem_pages: int = 100) -> None:
    idx = sorted(pages)
    write_diff(path, indexes=idx, data=b"".join(pages[p] for p in idx), page_size=PS,
               mem_pages=mem_pages, base_sha256=BASE, config_sha256=CONF)


def test_large_page_aligned_data_is_written_direct(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture buffer (an mmap) of at least DIRECT_MIN goes to disk with O_DIRECT, the
    same bytes as a buffered write; bytes objects and small data take the buffered path."""
    import mmap

    from host.vmm.memsnap import diff as diffmod

    n = diffmod.DIRECT_MIN // PS + 3
    buf = mmap.mmap(-1, n * PS)
    for i in range(n):
        buf[i * PS:(i + 1) * PS] = page(i)
    used: list[bool] = []
    real = diffmod._write_direct

    def spy(path: str, data: memoryview, offset: int) -> bool:
        used.append(real(path, data, offset))
        return used[-1]

    monkeypatch.setattr(diffmod, "_write_direct", spy)
    idx = list(range(0, 2 * n, 2))
    direct, buffered = tmp_path / "direct.diff", tmp_path / "buffered.diff"
    view = memoryview(buf)
    hdr = write_diff(direct, indexes=idx, data=view, page_size=PS, mem_pages=2 * n,
                     base_sha256=BASE, config_sha256=CONF)
    view.release()
    write_diff(buffered, indexes=idx, data=bytes(buf), page_size=PS, mem_pages=2 * n,
               base_sha256=BASE, config_sha256=CONF)
    assert used == [True, False]
    assert direct.read_bytes() == buffered.read_bytes()
    with DiffFile.open(direct) as f:
        f.verify()
        assert f.header.digest == hdr.digest and f.page(2 * (n - 1)) == page(n - 1)
    buf.close()  # no export of the buffer is left behind


def test_round_trip_and_independent_parse(tmp_path: Path) -> None:
    pages = {3: page(1), 4: page(2), 90: page(3)}
    path = tmp_path / "a.diff"
    write(path, pages)
    raw = path.read_bytes()
    # field by field, without the library
    assert raw[0:8] == b"AENVMDIF"
    version, page_size, count, mem_pages, kind, _ = struct.unpack_from("<IIQQII", raw, 8)
    assert (version, page_size, count, mem_pages, kind) == (1, PS, 3, 100, 0)
    assert raw[40:72] == BASE and raw[72:104] == CONF and raw[104:136] == bytes(32)
    (crc,) = struct.unpack_from("<I", raw, 168)
    assert crc == zlib.crc32(raw[:168])
    idx = struct.unpack_from("<3I", raw, 176)
    assert idx == (3, 4, 90)
    assert raw[176 + 12 : 4096] == bytes(4096 - 188)  # padding to 4 KiB
    assert len(raw) == 4096 + 3 * PS
    assert raw[4096:] == pages[3] + pages[4] + pages[90]
    assert raw[136:168] == hashlib.sha256(raw[176:188] + raw[4096:]).digest()
    with DiffFile.open(path) as f:
        assert list(f.indexes) == [3, 4, 90]
        assert f.header.kind == DiffKind.CUMULATIVE and f.count == 3
        assert f.page(4) == pages[4] and f.page(5) is None
        assert [(p, bytes(d)) for p, d in f.iter_pages()] == sorted(pages.items())
        f.check_belongs_to(BASE, CONF)
        with pytest.raises(SnapshotMismatchError):
            f.check_belongs_to(CONF)
        with pytest.raises(SnapshotMismatchError):
            f.check_belongs_to(BASE, BASE)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_empty_diff(tmp_path: Path) -> None:
    write(tmp_path / "e.diff", {})
    with DiffFile.open(tmp_path / "e.diff") as f:
        assert f.count == 0 and os.path.getsize(tmp_path / "e.diff") == 4096


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:100], "truncated header"),
        (lambda b: b[: 4096 + PS], "truncated"),
        (lambda b: b + b"x", "size"),
        (lambda b: b"XXXXXXXX" + b[8:], "magic"),
        (lambda b: b[:20] + b"\x07" + b[21:], "header checksum"),
        (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum"),
        (lambda b: b[:180] + b"\x03" + b[181:], "checksum"),  # index 2 -> 3: still sorted
        (lambda b: b[:176] + b"\x09" + b[177:], "out of order"),
    ],
)
def test_damaged_files_raise_clear_errors(tmp_path: Path, damage, match: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "d.diff"
    write(path, {1: page(1), 2: page(2)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptSnapshotError, match=match):
        DiffFile.open(path)


def test_a_diff_is_hashed_once_per_process_until_it_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The children of one fork restore the same diff at once: one of them hashes it, the
    others wait for that check; a file changed in place is hashed (and refused) again."""
    path = tmp_path / "f.diff"
    write(path, {i: page(i) for i in range(1, 60)})
    hashed: list[int] = []
    real = DiffFile._hash_check

    def counting(self: DiffFile) -> None:
        hashed.append(1)
        time.sleep(0.05)  # the other threads arrive while the first one hashes
        real(self)

    monkeypatch.setattr(DiffFile, "_hash_check", counting)

    def open_and_verify() -> None:
        with DiffFile.open(path, verify=False) as f:
            f.verify()

    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: open_and_verify(), range(16)))
    assert len(hashed) == 1
    DiffFile.open(path).close()
    assert len(hashed) == 1
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 1  # one bit of the last page's data
    time.sleep(0.02)  # past the kernel's coarse timestamp tick
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(raw)
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        DiffFile.open(path)
    assert len(hashed) == 2
    with pytest.raises(CorruptSnapshotError, match="checksum"):  # a failure is not kept
        DiffFile.open(path)
    assert len(hashed) == 3


def test_write_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(MemSnapError, match="increasing"):
        write_diff(tmp_path / "x", indexes=[2, 1], data=bytes(2 * PS), page_size=PS, mem_pages=10,
                   base_sha256=BASE, config_sha256=CONF)
    with pytest.raises(MemSnapError, match="beyond"):
        write_diff(tmp_path / "x", indexes=[10], data=bytes(PS), page_size=PS, mem_pages=10,
                   base_sha256=BASE, config_sha256=CONF)
    with pytest.raises(MemSnapError, match="bytes of data"):
        write_diff(tmp_path / "x", indexes=[1], data=bytes(10), page_size=PS, mem_pages=10,
                   base_sha256=BASE, config_sha256=CONF)
    with pytest.raises(MemSnapError, match="parent"):
        write_diff(tmp_path / "x", indexes=[], data=b"", page_size=PS, mem_pages=10,
                   base_sha256=BASE, config_sha256=CONF, kind=DiffKind.DELTA)
    assert not os.listdir(tmp_path)


def test_chain_rejects_wrong_parent_and_order(tmp_path: Path) -> None:
    write(tmp_path / "a", {1: page(1)})
    write(tmp_path / "b", {2: page(2)})
    with DiffChain.open([tmp_path / "a"]) as a:
        write_delta(tmp_path / "a1", a, [1, 5], page(9) + page(5))
    with pytest.raises(SnapshotMismatchError, match="not a delta on top"):
        DiffChain.open([tmp_path / "b", tmp_path / "a1"])
    with pytest.raises(SnapshotMismatchError, match="must start with a cumulative"):
        DiffChain.open([tmp_path / "a1"])
    with pytest.raises(SnapshotMismatchError, match="only the first"):
        DiffChain.open([tmp_path / "a", tmp_path / "b"])
    with DiffChain.open([tmp_path / "a", tmp_path / "a1"]) as ch:
        assert ch.page(1) == page(9) and ch.page(5) == page(5) and ch.page(2) is None


def test_delta_keeps_only_changed_pages_and_reverted_ones(tmp_path: Path) -> None:
    base = tmp_path / "base.mem"
    base.write_bytes(b"".join(page(1000 + p) for p in range(100)))
    write(tmp_path / "a", {1: page(1), 2: page(2), 3: page(3)})
    with DiffChain.open([tmp_path / "a"]) as a:
        # page 1 unchanged, 2 changed, 3 went back to the base (no longer private), 7 new
        idx, data = delta_pages(a, [1, 2, 7], page(1) + page(22) + page(7), base_path=base)
        assert list(idx) == [2, 3, 7]
        assert bytes(data) == page(22) + page(1003) + page(7)
        with pytest.raises(MemSnapError, match="base_path"):
            delta_pages(a, [1, 2], page(1) + page(2))


# -- property test against a reference dict of page -> bytes ---------------------------------

MEM = 64
steps = st.lists(st.dictionaries(st.integers(0, MEM - 1), st.integers(0, 5), max_size=20),
                 min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, bound=st.integers(1, 4))
def test_chain_compose_compact_delta_match_reference(tmp_path_factory: pytest.TempPathFactory,
                                                     steps: list[dict[int, int]], bound: int) -> None:
    d = tmp_path_factory.mktemp("prop")
    base = d / "base.mem"
    base.write_bytes(b"".join(page(-p - 1) for p in range(MEM)))
    ref: dict[int, bytes] = {}  # what a capture would see: every page ever written (cumulative)
    paths: list[Path] = []
    for n, step in enumerate(steps):
        for p, tag in step.items():
            ref[p] = page(tag * 1000 + p)
        idx = sorted(ref)
        data = b"".join(ref[p] for p in idx)
        path = d / f"s{n}.diff"
        if not paths:
            write_diff(path, indexes=idx, data=data, page_size=PS, mem_pages=MEM,
                       base_sha256=BASE, config_sha256=CONF)
        else:
            with DiffChain.open(paths) as parent:
                h = write_delta(path, parent, idx, data, base_path=base)
                changed = {p for p in idx if parent.page(p) != ref[p]}
                assert h.count == len(changed)
        paths.append(path)
        with DiffChain.open(paths) as chain:
            cidx, cdata = chain.compose()
            assert list(cidx) == idx
            assert bytes(cdata) == data
            for p in range(MEM):
                assert chain.page(p) == ref.get(p)
        chain = DiffChain.open(paths)
        flat = compact(chain, d / f"flat{n}.diff", max_len=bound)
        try:
            if len(paths) > bound:
                assert flat is not chain and len(flat) == 1
                assert flat.first.kind == DiffKind.CUMULATIVE
            else:
                assert flat is chain
            fidx, fdata = flat.compose()
            assert list(fidx) == idx and bytes(fdata) == data
        finally:
            flat.close()
            chain.close()
    with DiffChain.open(paths) as chain:
        h = write_cumulative(chain, d / "all.diff")
        assert h.count == len(ref)
    assert array("I", sorted(ref)).tolist() == sorted(ref)
