"""Property test through the wire: random NBD requests (unaligned too), seals and clones on a
running block server read back what a flat reference holds."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import BlockServerProc
from .test_blockserver import RawNbd

VSIZE = 256 * 1024
_names = itertools.count()

ranges = st.tuples(st.integers(0, VSIZE - 1), st.integers(1, 70000)).map(
    lambda t: (t[0], min(t[1], VSIZE - t[0])))
ops = st.one_of(
    st.tuples(st.just("write"), ranges, st.integers(1, 255)),
    st.tuples(st.just("zero"), ranges, st.just(0)),
    st.tuples(st.just("trim"), ranges, st.just(0)),
    st.tuples(st.just("read"), ranges, st.just(0)),
    st.tuples(st.just("flush"), st.just((0, 0)), st.just(0)),
    st.tuples(st.just("seal"), st.just((0, 0)), st.just(0)),
    st.tuples(st.just("clone"), st.just((0, 0)), st.just(0)),
)


@pytest.fixture(scope="module")
def shared_blockserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlockServerProc]:
    root = tmp_path_factory.mktemp("nbdprop")
    bs = BlockServerProc(root / "bs", repo=f"posix_fs:{root / 'repo'}")
    bs.root.mkdir()
    bs.start()
    try:
        yield bs
    finally:
        bs.stop()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ops, min_size=1, max_size=25))
def test_nbd_requests_match_flat_reference(shared_blockserver: BlockServerProc,
                                           program: list[Any]) -> None:
    bs = shared_blockserver
    name = f"p{next(_names)}"
    bs.client.create(name, virtual_size=VSIZE)
    conn = RawNbd(bs.nbd_socket)
    conn.go(name)
    ref = bytearray(VSIZE)
    clones: list[tuple[str, bytes]] = []
    try:
        for op, (off, length), byte in program:
            if op == "write":
                data = bytes([byte]) * length
                assert conn.request(1, off, length, data)[0] == 0
                ref[off:off + length] = data
            elif op in ("zero", "trim"):
                assert conn.request(6 if op == "zero" else 4, off, length)[0] == 0
                ref[off:off + length] = bytes(length)
            elif op == "read":
                err, got = conn.request(0, off, length)
                assert err == 0 and got == bytes(ref[off:off + length])
            elif op == "flush":
                assert conn.request(3, 0, 0)[0] == 0
            elif op == "seal":
                bs.client.seal(name, upload=False)
            else:
                cname = f"{name}c{len(clones)}"
                bs.client.clone(name, cname)
                clones.append((cname, bytes(ref)))
        err, got = conn.request(0, 0, VSIZE)
        assert err == 0 and got == bytes(ref)
        for cname, cref in clones:  # clones kept the state they were forked from
            c = RawNbd(bs.nbd_socket)
            c.go(cname)
            assert c.request(0, 0, VSIZE) == (0, cref)
            c.s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, 1, 0, 0))
            c.close()
            bs.client.delete(cname)
    finally:
        conn.close()
        bs.client.delete(name)
