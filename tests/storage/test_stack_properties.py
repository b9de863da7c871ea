"""Property tests: random writes/zeroes/seals/clones/reopens on stacks read back exactly
what a flat reference bytearray holds."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host.storage.blob import FileBlob
from host.storage.lsmt import SealedLayer, digest_of_file
from host.storage.stack import Stack
from host.storage.upper import Upper

VSIZE = 64 * 1024

_counter = itertools.count()


def _placer(root: Path) -> Callable[[str, Path], Path]:
    def place(digest: str, src: Path) -> Path:
        dst = root / "layers" / (digest.split(":")[1] + ".lsmt")
        dst.parent.mkdir(exist_ok=True)
        os.replace(src, dst)
        return dst

    return place


def _path(layer: SealedLayer) -> Path:
    blob = layer.blob
    assert isinstance(blob, FileBlob)
    return blob.path


ranges = st.tuples(st.integers(0, VSIZE - 1), st.integers(1, 9000)).map(
    lambda t: (t[0], min(t[1], VSIZE - t[0]))
)
ops = st.one_of(
    st.tuples(st.just("write"), st.integers(0, 3), ranges, st.integers(0, 255)),
    st.tuples(st.just("zero"), st.integers(0, 3), ranges, st.just(0)),
    st.tuples(st.just("seal"), st.integers(0, 3), st.just((0, 0)), st.just(0)),
    st.tuples(st.just("clone"), st.integers(0, 3), st.just((0, 0)), st.just(0)),
    st.tuples(st.just("reopen"), st.integers(0, 3), st.just((0, 0)), st.just(0)),
    st.tuples(st.just("read"), st.integers(0, 3), ranges, st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ops, min_size=1, max_size=40))
def test_stack_matches_flat_reference(tmp_path: Path, program: list[Any]) -> None:
    root = tmp_path / f"run{next(_counter)}"
    root.mkdir()
    place = _placer(root)
    n = itertools.count()

    def new_upper(parent: str = "") -> Upper:
        return Upper.create(root / f"upper{next(n)}", VSIZE, parent_uuid=parent)

    stacks = [Stack("s0", [], new_upper())]
    refs = [bytearray(VSIZE)]
    try:
        for op, which, (off, length), byte in program:
            i = which % len(stacks)
            stack, ref = stacks[i], refs[i]
            if op == "write":
                data = bytes([byte]) * length
                stack.write(off, data)
                ref[off:off + length] = data
            elif op == "zero":
                stack.write_zeroes(off, length)
                ref[off:off + length] = bytes(length)
            elif op == "seal":
                stack.seal(place, root / f"upper{next(n)}")
            elif op == "clone":
                if len(stack.upper.index):
                    stack.seal(place, root / f"upper{next(n)}")
                stacks.append(stack.fork(f"s{len(stacks)}", new_upper()))
                refs.append(bytearray(ref))
            elif op == "reopen":
                # flush, drop the process state, reopen layers from disk and the upper from
                # its journal: the stack must rebuild the same merged view
                stack.flush()
                layers = [SealedLayer.open_path(_path(layer), digest=layer.digest)
                          for layer in stack.layers]
                upper_dir = stack.upper.dir
                stack.upper.close()
                stacks[i] = Stack(stack.name, layers, Upper.open(upper_dir))
            else:
                assert stack.read(off, length) == bytes(ref[off:off + length])
        for stack, ref in zip(stacks, refs):
            assert stack.read(0, VSIZE) == bytes(ref)
            for layer in stack.layers:  # every sealed layer re-parses from disk
                SealedLayer.open_path(_path(layer)).close()
                assert digest_of_file(_path(layer)) == layer.digest  # content-addressed
    finally:
        for stack in stacks:
            stack.close()
