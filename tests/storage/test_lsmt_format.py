"""The on-disk LSMT format checked field by field with an independent parser, bad layer
files, crash recovery of a flushed upper, and image conversion."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from host.storage.convert import convert_image
from host.storage.errors import LayerFormatError
from host.storage.lsmt import LayerWriter, SealedLayer, digest_of_file
from host.storage.stack import Stack
from host.storage.upper import Upper

REPO = Path(__file__).resolve().parents[2]

# --- an independent parser written from format_spec.md, not from host.storage.lsmt ---
MAGIC0 = b"LSMT\x00\x01\x02\x00"
MAGIC1 = bytes([0x65, 0x7E, 0x63, 0xD2, 0x94, 0x44, 0x08, 0x4C,
                0xA2, 0xD2, 0xC8, 0xEC, 0x4F, 0xCF, 0xAE, 0x8A])


def parse_ht(buf: bytes) -> dict[str, Any]:
    assert len(buf) == 4096
    f = {
        "magic0": buf[0:8],
        "magic1": buf[8:24],
        "size": struct.unpack_from("<I", buf, 24)[0],
        "flags": struct.unpack_from("<I", buf, 28)[0],
        "index_offset": struct.unpack_from("<Q", buf, 32)[0],
        "index_size": struct.unpack_from("<Q", buf, 40)[0],
        "virtual_size": struct.unpack_from("<Q", buf, 48)[0],
        "uuid": buf[56:93],
        "parent_uuid": buf[93:130],
        "version": buf[132],
        "sub_version": buf[133],
        "user_tag": buf[134:390],
        "reserved": buf[390:4096],
    }
    return f


def parse_entries(buf: bytes) -> list[tuple[int, int, int, int, int]]:
    out = []
    for i in range(0, len(buf), 16):
        lo, hi = struct.unpack_from("<QQ", buf, i)
        offset = lo & ((1 << 50) - 1)
        length = lo >> 50
        moffset = hi & ((1 << 55) - 1)
        zeroed = (hi >> 55) & 1
        tag = hi >> 56
        out.append((offset, length, moffset, zeroed, tag))
    return out


def test_layer_format_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "l.lsmt"
    w = LayerWriter(path, 1 << 20, uuid="11111111-2222-3333-4444-555555555555",
                    parent_uuid="66666666-7777-8888-9999-000000000000", user_tag=b"hello")
    w.write(8192, b"\xaa" * 4096)  # sectors 16..24
    w.write(0, b"\xbb" * 1024)  # sectors 0..2
    w.zero(65536, 8192)  # sectors 128..144, zeroed
    digest = w.finish()
    raw = path.read_bytes()
    assert digest == digest_of_file(path)

    h = parse_ht(raw[:4096])
    t = parse_ht(raw[-4096:])
    for ht in (h, t):
        assert ht["magic0"] == MAGIC0 and ht["magic1"] == MAGIC1
        assert ht["size"] == 390
        assert ht["virtual_size"] == 1 << 20
        assert ht["uuid"] == b"11111111-2222-3333-4444-555555555555\x00"
        assert ht["parent_uuid"] == b"66666666-7777-8888-9999-000000000000\x00"
        assert ht["version"] == 1 and ht["sub_version"] == 1
        assert ht["user_tag"].rstrip(b"\x00") == b"hello"
        assert ht["reserved"] == bytes(3706)
    assert h["flags"] == 0b011  # header, data file, not sealed
    assert t["flags"] == 0b110  # trailer, data file, sealed
    assert t["index_offset"] == 4096 + 4096 + 1024  # after the data section
    assert t["index_offset"] + t["index_size"] * 16 == len(raw) - 4096
    assert t["index_size"] % 256 == 0  # padded to 4 KiB with invalid entries
    entries = parse_entries(raw[t["index_offset"]:t["index_offset"] + t["index_size"] * 16])
    real = [e for e in entries if e[0] != (1 << 50) - 1]
    assert all(e[1] == 0 for e in entries if e[0] == (1 << 50) - 1)
    assert real == [
        (0, 2, (4096 + 4096) // 512, 0, 0),
        (16, 8, 4096 // 512, 0, 0),
        (128, 16, 0, 1, 0),
    ]
    # data where the entries say
    assert raw[4096:8192] == b"\xaa" * 4096
    assert raw[8192:9216] == b"\xbb" * 1024
    # and our reader agrees
    layer = SealedLayer.open_path(path)
    stack = Stack("t", [layer], Upper.create(tmp_path / "u", 1 << 20))
    assert stack.read(0, 1024) == b"\xbb" * 1024
    assert stack.read(8192, 4096) == b"\xaa" * 4096
    assert stack.read(65536, 8192) == bytes(8192)
    stack.close()
    layer.close()


def test_long_extent_splits_into_14_bit_entries(tmp_path: Path) -> None:
    path = tmp_path / "big.lsmt"
    w = LayerWriter(path, 32 << 20)
    w.write(0, os.urandom(20 << 20))
    w.finish()
    raw = path.read_bytes()
    t = parse_ht(raw[-4096:])
    entries = [e for e in parse_entries(raw[t["index_offset"]:-4096]) if e[0] != (1 << 50) - 1]
    assert all(e[1] <= (1 << 14) - 1 for e in entries)
    assert sum(e[1] for e in entries) == (20 << 20) // 512
    layer = SealedLayer.open_path(path)
    assert layer.blob.pread(4096, 16) == raw[4096:4112]
    layer.close()


def _good_layer(tmp_path: Path) -> bytes:
    p = tmp_path / "good.lsmt"
    w = LayerWriter(p, 1 << 20)
    w.write(0, b"x" * 8192)
    w.finish()
    return p.read_bytes()


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:100], "truncated"),
    (lambda b: b[:-1], "wrong magic|trailer"),
    (lambda b: b[:-4096], "trailer|magic"),
    (lambda b: b"XXXX" + b[4:], "wrong magic"),
    (lambda b: b[:-4096] + b"JUNK" + b[-4092:], "wrong magic"),
    (lambda b: b[:-4096] + b[-4096:-4096 + 40] + struct.pack("<Q", 10**9) + b[-4096 + 48:],
     "runs past the trailer"),
], ids=["truncated", "cut-one-byte", "no-trailer", "bad-header-magic", "bad-trailer-magic",
        "index-size-too-big"])
def test_bad_layer_files_raise_layer_format_error(
        tmp_path: Path, damage: Callable[[bytes], bytes], message: str) -> None:
    bad = tmp_path / "bad.lsmt"
    bad.write_bytes(damage(_good_layer(tmp_path)))
    with pytest.raises(LayerFormatError, match=message):
        SealedLayer.open_path(bad)


def test_index_pointing_past_data_is_rejected(tmp_path: Path) -> None:
    raw = bytearray(_good_layer(tmp_path))
    t = parse_ht(bytes(raw[-4096:]))
    # first entry: moffset far beyond the data section
    lo, hi = struct.unpack_from("<QQ", raw, t["index_offset"])
    struct.pack_into("<QQ", raw, t["index_offset"], lo, (hi & ~((1 << 55) - 1)) | 10_000)
    bad = tmp_path / "past.lsmt"
    bad.write_bytes(raw)
    with pytest.raises(LayerFormatError, match="points past data"):
        SealedLayer.open_path(bad)


def test_unsealed_upper_is_not_a_sealed_layer(tmp_path: Path) -> None:
    up = Upper.create(tmp_path / "u", 1 << 20)
    up.write(0, b"y" * 4096)
    up.flush()
    with pytest.raises(LayerFormatError, match="not sealed|magic"):
        SealedLayer.open_path(tmp_path / "u" / "data.lsmt")
    up.close()


CRASH_CHILD = textwrap.dedent("""
    import os, sys, signal
    from host.storage.upper import Upper
    from host.storage.stack import Stack
    up = Upper.create(sys.argv[1], 8 << 20)
    st = Stack("c", [], up)
    for i in range(64):
        st.write(i * 65536 + (i % 7) * 512, bytes([i + 1]) * (4096 + i * 512))
    st.write_zeroes(5 * 65536, 8192)
    st.flush()
    print("flushed", flush=True)
    # unflushed writes after the flush may or may not survive; flushed ones must
    for i in range(1000):
        st.write((i * 4096) % (8 << 20), b"\\xee" * 4096)
    sys.stdin.read()  # wait to be killed
""")


def _killed_after(child: str, d: Path, marker: bytes) -> None:
    """Run `child` on upper dir `d` until it prints `marker`, then SIGKILL it."""
    proc = subprocess.Popen([sys.executable, "-c", child, str(d)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == marker
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def test_flushed_upper_survives_sigkill(tmp_path: Path) -> None:
    d = tmp_path / "upper"
    _killed_after(CRASH_CHILD, d, b"flushed")
    ref = bytearray(8 << 20)
    for i in range(64):
        off = i * 65536 + (i % 7) * 512
        ref[off:off + 4096 + i * 512] = bytes([i + 1]) * (4096 + i * 512)
    ref[5 * 65536:5 * 65536 + 8192] = bytes(8192)
    st = Stack("c", [], Upper.open(d))
    got = st.read(0, 8 << 20)
    # bytes no later write touched are exactly the flushed ones; bytes rewritten after the
    # flush (unflushed, in place or appended) hold either the flushed or the newer value,
    # as on any disk
    later = 1000 * 4096
    assert got[later:] == bytes(ref[later:])
    for pos in range(0, later, 512):
        sector = got[pos:pos + 512]
        assert sector == bytes(ref[pos:pos + 512]) or sector == b"\xee" * 512, pos
    assert got != b"\xee" * len(got)
    # and it keeps working as an upper
    st.write(0, b"z" * 512)
    st.flush()
    st.close()
    st = Stack("c", [], Upper.open(d))
    assert st.read(0, 512) == b"z" * 512
    st.close()


KILLED_CHILD = textwrap.dedent("""
    import sys
    from host.storage.upper import Upper
    from host.storage.stack import Stack
    st = Stack("c", [], Upper.create(sys.argv[1], 8 << 20))
    for i in range(200):  # acknowledged writes, never flushed
        st.write(i * 8192, bytes([i % 250 + 1]) * 8192)
    st.write_zeroes(0, 4096)
    print("written", flush=True)
    sys.stdin.read()  # wait to be killed
""")


def test_acknowledged_writes_survive_a_killed_process_without_a_flush(tmp_path: Path) -> None:
    """A block server that dies keeps what it acknowledged (the page cache has it): a VM's
    NBD client resends only what was in flight, its flush included, to the next server."""
    d = tmp_path / "upper"
    _killed_after(KILLED_CHILD, d, b"written")
    st = Stack("c", [], Upper.open(d))
    try:
        got = st.read(0, 200 * 8192)
        for i in range(200):
            want = bytes([i % 250 + 1]) * 8192
            if i == 0:
                want = bytes(4096) + want[4096:]
            assert got[i * 8192:(i + 1) * 8192] == want, i
    finally:
        st.close()


def test_journal_entries_past_the_data_are_dropped(tmp_path: Path) -> None:
    """After a host crash the journal may have reached the disk before the data it names:
    those unflushed writes are lost, the flushed ones kept, the upper opens."""
    st = Stack("c", [], Upper.create(tmp_path / "u", 1 << 20))
    st.write(0, b"a" * 4096)
    st.flush()
    st.write(8192, b"b" * 4096)
    st.write(16384, b"c" * 4096)
    st.close()
    data = tmp_path / "u" / "data.lsmt"
    os.truncate(data, data.stat().st_size - 8192)  # the last two writes' data never landed
    st = Stack("c", [], Upper.open(tmp_path / "u"))
    assert st.read(0, 4096) == b"a" * 4096 and st.read(8192, 12288) == bytes(12288)
    st.write(8192, b"d" * 4096)  # and it goes on as an upper
    st.flush()
    st.close()
    st = Stack("c", [], Upper.open(tmp_path / "u"))
    assert st.read(8192, 4096) == b"d" * 4096 and st.read(0, 4096) == b"a" * 4096
    st.close()


def test_torn_journal_tail_is_dropped(tmp_path: Path) -> None:
    up = Upper.create(tmp_path / "u", 1 << 20)
    up.write(0, b"a" * 4096)
    up.flush()
    up.close()
    with open(tmp_path / "u" / "index.lsmt", "ab") as f:
        f.write(b"\x01" * 7)  # half an entry, as if cut mid-append
    up = Upper.open(tmp_path / "u")
    assert up.pread(4096, 4096) == b"a" * 4096
    up.close()


def _ext4_image(tmp_path: Path) -> Path:
    mkfs = shutil.which("mkfs.ext4")
    if mkfs is None:
        pytest.skip("mkfs.ext4 not installed")
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "hostname").write_text("aenv\n")
    (tree / "blob.bin").write_bytes(os.urandom(3 << 20))
    img = tmp_path / "rootfs.ext4"
    subprocess.run([mkfs, "-q", "-F", "-d", str(tree), str(img), "32M"], check=True)
    return img


def test_convert_ext4_image_round_trips(tmp_path: Path) -> None:
    img = _ext4_image(tmp_path)
    out = tmp_path / "layers"
    out.mkdir()
    path, digest, vsize = convert_image(img, out)
    assert path.name == digest.split(":")[1] + ".lsmt"
    assert vsize == img.stat().st_size
    assert path.stat().st_size < vsize // 2  # zero blocks skipped
    layer = SealedLayer.open_path(path, digest=digest)
    st = Stack("r", [layer], Upper.create(tmp_path / "u", vsize))
    assert st.read(0, vsize) == img.read_bytes()
    st.close()
    layer.close()


def test_convert_cli(tmp_path: Path) -> None:
    img = tmp_path / "raw.img"
    data = bytearray(1 << 20)
    data[4096:8192] = b"q" * 4096
    data[-100:] = b"t" * 100
    img.write_bytes(bytes(data) + b"odd")  # not sector-aligned in size
    out = subprocess.run([sys.executable, "-m", "host.storage.convert", str(img),
                          str(tmp_path / "l.lsmt"), "--repo", f"posix_fs:{tmp_path / 'repo'}"],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    import json

    doc = json.loads(out)
    assert doc["virtual_size"] == (1 << 20) + 512
    assert (tmp_path / "repo" / "layers" / (doc["digest"][7:] + ".lsmt")).exists()
    layer = SealedLayer.open_path(doc["path"])
    st = Stack("r", [layer], Upper.create(tmp_path / "u", doc["virtual_size"]))
    assert st.read(0, len(data) + 3) == bytes(data) + b"odd"
    st.close()
    layer.close()


def test_in_place_rewrite_then_seal_keeps_digest_honest(tmp_path: Path) -> None:
    st = Stack("r", [], Upper.create(tmp_path / "u", 1 << 20))
    st.write(0, b"a" * 65536)
    size_before = st.upper.out.pos
    st.write(4096, b"b" * 8192)  # inside an extent the upper owns: rewritten in place
    assert st.upper.out.pos == size_before
    assert st.read(0, 16384) == b"a" * 4096 + b"b" * 8192 + b"a" * 4096

    def place(digest: str, src: Path) -> Path:
        return src

    layer = st.seal(place, tmp_path / "u2")
    assert layer.digest == digest_of_file(tmp_path / "u" / "data.lsmt")
    assert st.read(0, 16384) == b"a" * 4096 + b"b" * 8192 + b"a" * 4096
    st.close()
    layer.close()


def test_convert_delta_over_base_image(tmp_path: Path) -> None:
    base = bytearray(os.urandom(2 << 20))
    base[1 << 20:(1 << 20) + 65536] = bytes(65536)
    top = bytearray(base)
    top[4096:8192] = b"n" * 4096  # changed block
    top[65536:131072] = bytes(65536)  # blocks zeroed over data
    top[(1 << 20) + 4096:(1 << 20) + 8192] = b"m" * 4096  # data where base had zeros
    top += b"tail" * 1024  # grew by 4 KiB
    (tmp_path / "base.img").write_bytes(base)
    (tmp_path / "top.img").write_bytes(top)
    out = tmp_path / "l"
    out.mkdir()
    bpath, bdigest, _ = convert_image(tmp_path / "base.img", out)
    blayer = SealedLayer.open_path(bpath, digest=bdigest)
    tpath, tdigest, tsize = convert_image(tmp_path / "top.img", out, base=tmp_path / "base.img",
                                          parent_uuid=blayer.uuid)
    assert tpath.stat().st_size < 64 * 1024  # only the delta
    tlayer = SealedLayer.open_path(tpath, digest=tdigest)
    assert tlayer.trailer.parent_uuid == blayer.uuid
    st = Stack("d", [blayer, tlayer], Upper.create(tmp_path / "u", tsize))
    assert st.read(0, tsize) == bytes(top)
    st.close()
    blayer.close()
    tlayer.close()
