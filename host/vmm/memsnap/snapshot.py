"""Incremental memory snapshots of a running child VM, and restores into a fresh one.

A child runs on a frozen base with ``memory-backend-file,share=off`` (see ``base.py``).

* ``snapshot_incremental``: stop -> xen-save-devices-state -> scan + process_vm_readv the private
  pages into memory -> cont (the guest's downtime ends here) -> write the diff (cumulative, or a
  content delta against ``parent``), the spliced device state and ``snapshot.json`` (last: it is
  the commit point).
* ``restore_into``: into a QEMU spawned on the same base with ``share=off -incoming defer -S``:
  verify every file -> process_vm_writev the chain -> migrate-incoming the device state -> cont.
  On error the target VM is in an undefined state: the caller must kill it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import mmap
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from host.durable import write_atomic
from host.hostmem import node_available_mib

from .base import BaseImage, verify_base
from .capture import Capture, CaptureBuffer, alloc_buffer, capture_private, file_buffer
from .chain import DiffChain, write_delta
from .devstate import load_device_state, qmp_execute, save_device_state, splice
from .diff import DiffKind, write_diff
from .errors import CorruptSnapshotError, MemSnapError, SnapshotMismatchError
from .inject import inject_chain
from .pagemap import PAGE_SIZE, find_vma, scan_private

SNAPSHOT_MANIFEST = "snapshot.json"


def config_digest(argv: Sequence[str]) -> bytes:
    """Hash of a QEMU configuration. Pass the argv with per-instance parts (socket paths,
    work dirs, ``-incoming``) normalised, so the same VM shape gives the same digest."""
    return hashlib.sha256("\0".join(argv).encode()).digest()


@dataclass(frozen=True)
class MemSnapshot:
    """A committed snapshot: a diff chain (oldest first) on a base, plus device state."""

    dir: Path
    base_sha256: bytes
    config_sha256: bytes
    diffs: tuple[Path, ...]
    digests: tuple[bytes, ...]
    devstate: Path
    devstate_sha256: bytes
    stats: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def diff(self) -> Path:
        """This snapshot's own (newest) diff."""
        return self.diffs[-1]

    def open_chain(self, *, verify: bool = True) -> DiffChain:
        chain = DiffChain.open(self.diffs, verify=verify)
        got = tuple(f.digest for f in chain.files)
        if got != self.digests:
            chain.close()
            raise CorruptSnapshotError(f"{self.dir}: the diff files do not match the manifest's digests")
        return chain

    @classmethod
    def load(cls, dir: str | os.PathLike[str]) -> Self:
        d = Path(dir)
        path = d / SNAPSHOT_MANIFEST
        try:
            m = json.loads(path.read_text())
            return cls(
                d, bytes.fromhex(m["base_sha256"]), bytes.fromhex(m["config_sha256"]),
                tuple(Path(os.path.normpath(d / p)) for p in m["diffs"]),
                tuple(bytes.fromhex(x) for x in m["digests"]),
                d / m["devstate"], bytes.fromhex(m["devstate_sha256"]), dict(m.get("stats", {})),
            )
        except FileNotFoundError as exc:
            raise MemSnapError(f"no snapshot in {d} (missing {SNAPSHOT_MANIFEST})") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptSnapshotError(f"{path}: malformed snapshot manifest: {exc}") from exc

    def _manifest(self) -> bytes:
        return json.dumps({
            "version": 1, "base_sha256": self.base_sha256.hex(), "config_sha256": self.config_sha256.hex(),
            # relative to the snapshot dir: a memory dir tree can be moved or fetched
            # elsewhere (another node's state dir) and still load
            "diffs": [os.path.relpath(p, self.dir) for p in self.diffs],
            "digests": [x.hex() for x in self.digests],
            "devstate": self.devstate.name, "devstate_sha256": self.devstate_sha256.hex(),
            "stats": self.stats,
        }, indent=1).encode()


async def snapshot_incremental(
    qmp: Any,
    pid: int,
    mem_path: str | os.PathLike[str],
    base: BaseImage,
    dest_dir: str | os.PathLike[str],
    *,
    config_sha256: bytes,
    parent: MemSnapshot | None = None,
    max_chain: int = 8,
    resume: bool = True,
    fsync: bool = True,
    scan_method: str = "auto",
    buffer: CaptureBuffer | None = None,
    while_stopped: Callable[[], Awaitable[None]] | None = None,
    spill_over: int | None = None,
) -> MemSnapshot:
    """Snapshot the child VM ``pid`` (QMP ``qmp``) whose RAM maps ``mem_path`` (= the base file).

    With ``parent``, writes a content delta on top of the parent's chain, unless the chain
    would exceed ``max_chain`` diffs: then a cumulative diff (the capture is always cumulative,
    so this compaction costs nothing extra). ``resume`` continues a guest that was running.
    ``stats`` holds ``downtime_ms`` (stop -> cont) and ``total_ms``. ``buffer``: reuse the
    copy buffer of earlier snapshots of this VM (else one is allocated and freed per call).
    ``while_stopped`` runs after the capture, before ``cont``: what must be cut at the same
    instant as memory (e.g. sealing the disk); the diff is written after the guest resumed.
    ``spill_over``: when the guest stays stopped (a pause) and its copy would be larger
    than this many bytes (default: half the memory the node has available, host or
    cgroup), it goes to page cache instead of anonymous memory (file_buffer): slower, but
    a pause under memory pressure then needs no memory it cannot give back.
    """
    d = Path(dest_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    if parent is not None and (parent.base_sha256, parent.config_sha256) != (base.sha256, config_sha256):
        raise SnapshotMismatchError(f"parent snapshot {parent.dir} belongs to another base or configuration")
    t_call = time.perf_counter()
    status = (await qmp_execute(qmp, "query-status"))["status"]
    was_running = status == "running"
    xen = d / ".devices.xen"
    vma = find_vma(pid, mem_path)

    stays_stopped = not (resume and was_running)
    spill = d / ".capture"
    spilling = False

    def _prepare() -> mmap.mmap:
        # Pre-fault the copy buffer while the guest still runs (sized from a scan now, with
        # slack for pages dirtied until the stop): allocation must not count as downtime.
        nonlocal spilling
        n0 = sum(c for _, c in scan_private(pid, vma, method=scan_method))
        need = n0 + max(1024, n0 // 8)
        limit = spill_over
        if stays_stopped and limit is None:
            limit = node_available_mib() * 1024 * 1024 // 2
        spilling = stays_stopped and limit is not None and need * PAGE_SIZE > limit
        if spilling:
            return file_buffer(spill, need)
        return buffer.reserve(need) if buffer is not None else alloc_buffer(need)

    buf: mmap.mmap | None = await asyncio.to_thread(_prepare)
    owned = buffer is None or spilling
    grow = (lambda n: file_buffer(spill, n)) if spilling else None
    cap: Capture | None = None
    t0 = time.perf_counter()
    resumed = False
    try:
        await qmp_execute(qmp, "stop")
        t_stop = time.perf_counter()
        await save_device_state(qmp, xen)
        t_dev = time.perf_counter()
        captured = capture_private(pid, vma, method=scan_method, buffer=buf, owned=owned,
                                   grow=grow)
        cap, buf = captured, None
        t_cap = time.perf_counter()
        if while_stopped is not None:
            await while_stopped()
        t_hook = time.perf_counter()
        if resume and was_running:
            await qmp_execute(qmp, "cont")
            resumed = True
        t_cont = time.perf_counter()

        def _write() -> tuple[Any, ...]:
            diff_path = d / "mem.diff"
            if parent is None or len(parent.diffs) + 1 > max_chain:
                hdr = write_diff(diff_path, indexes=captured.indexes, data=captured.data, page_size=captured.page_size,
                                 mem_pages=captured.mem_pages, base_sha256=base.sha256,
                                 config_sha256=config_sha256, kind=DiffKind.CUMULATIVE, fsync=fsync)
                chain_paths: tuple[Path, ...] = ()
                chain_digests: tuple[bytes, ...] = ()
            else:
                with parent.open_chain(verify=False) as pchain:
                    if pchain.mem_pages != captured.mem_pages:
                        raise SnapshotMismatchError("parent snapshot has another RAM size")
                    hdr = write_delta(diff_path, pchain, captured.indexes, captured.data,
                                      base_path=base.mem_path, fsync=fsync)
                chain_paths, chain_digests = parent.diffs, parent.digests
            devstate = d / "devstate.bin"
            blob = splice(base.template_path.read_bytes(), xen.read_bytes(),
                          template_name=str(base.template_path), devices_name=str(xen))
            write_atomic(devstate, blob, fsync=fsync)
            return (diff_path, hdr.digest, hdr.count, devstate, hashlib.sha256(blob).digest(),
                    chain_paths, chain_digests)

        diff_path, digest, count, devstate, dev_sha, chain_paths, chain_digests = (
            await asyncio.to_thread(_write))
    finally:
        xen.unlink(missing_ok=True)
        if cap is not None:
            captured.close()
        if buf is not None and owned:
            buf.close()
        if resume and was_running and not resumed:
            await qmp_execute(qmp, "cont")
    t_end = time.perf_counter()
    snap = MemSnapshot(
        d, base.sha256, config_sha256, (*chain_paths, diff_path.resolve()), (*chain_digests, digest),
        devstate, dev_sha,
        {
            "downtime_ms": (t_cont - t0) * 1e3, "total_ms": (t_end - t_call) * 1e3,
            "prepare_ms": (t0 - t_call) * 1e3,
            "stop_ms": (t_stop - t0) * 1e3, "devstate_ms": (t_dev - t_stop) * 1e3,
            "capture_ms": (t_cap - t_dev) * 1e3, "while_stopped_ms": (t_hook - t_cap) * 1e3,
            "scan_ms": captured.timings_ms["scan"],
            "readv_ms": captured.timings_ms["readv"],
            "captured_pages": captured.count, "diff_pages": count, "runs": captured.n_runs,
            "chain_len": len(chain_paths) + 1, "spilled": float(spilling),
        },
    )
    await asyncio.to_thread(write_atomic, d / SNAPSHOT_MANIFEST, snap._manifest(), fsync=fsync)
    return snap


@dataclass(frozen=True)
class RestoreStats:
    pages: int
    verify_ms: float
    inject_ms: float
    load_ms: float
    total_ms: float


async def restore_into(
    qmp: Any,
    pid: int,
    mem_path: str | os.PathLike[str],
    snapshot: MemSnapshot,
    base: BaseImage,
    *,
    config_sha256: bytes | None = None,
    resume: bool = True,
    timeout_s: float = 60.0,
) -> RestoreStats:
    """Restore ``snapshot`` into QEMU ``pid`` spawned on ``base`` with share=off,
    ``-incoming defer -S``. Every file is checked before the VM is touched; on any error the
    VM is half-restored and the caller must kill it."""
    t0 = time.perf_counter()
    if snapshot.base_sha256 != base.sha256:
        raise SnapshotMismatchError(
            f"snapshot {snapshot.dir} is for base {snapshot.base_sha256.hex()[:16]}, not {base.id[:16]}")
    if config_sha256 is not None and config_sha256 != snapshot.config_sha256:
        raise SnapshotMismatchError(f"snapshot {snapshot.dir} was taken with another QEMU configuration")
    if os.path.realpath(mem_path) != os.path.realpath(base.mem_path):
        raise SnapshotMismatchError(f"the VM maps {mem_path}, not the base file {base.mem_path}")
    verify_base(base)

    def _open() -> DiffChain:
        chain = snapshot.open_chain(verify=False)  # structure now, page checksums below
        try:
            dev = snapshot.devstate.read_bytes()
        except OSError as exc:
            chain.close()
            raise MemSnapError(f"cannot read device state {snapshot.devstate}: {exc}") from exc
        if hashlib.sha256(dev).digest() != snapshot.devstate_sha256:
            chain.close()
            raise CorruptSnapshotError(f"{snapshot.devstate}: device state checksum mismatch")
        return chain

    chain = await asyncio.to_thread(_open)
    try:
        t_verify = time.perf_counter()
        status = (await qmp_execute(qmp, "query-status"))["status"]
        if status != "inmigrate":
            raise MemSnapError(f"VM {pid} is {status!r}: restore needs a QEMU started with -incoming defer")
        vma = find_vma(pid, mem_path)

        def _verify() -> None:
            for f in chain.files:
                f.verify()

        # Check the page checksums while injecting (two threads: hashlib and the syscall both
        # drop the GIL). A bad diff raises before the device state is loaded or the guest
        # runs; the half-written VM is then killed by the caller.
        results = await asyncio.gather(asyncio.to_thread(_verify),
                                       asyncio.to_thread(inject_chain, pid, vma, chain),
                                       return_exceptions=True)
        verified, injected = results
        if isinstance(verified, BaseException):
            raise verified
        if isinstance(injected, BaseException):
            raise injected
        pages = injected
    finally:
        chain.close()
    t_inject = time.perf_counter()
    await load_device_state(qmp, snapshot.devstate, timeout_s=timeout_s)
    t_load = time.perf_counter()
    if resume:
        await qmp_execute(qmp, "cont")
    t_end = time.perf_counter()
    return RestoreStats(pages, (t_verify - t0) * 1e3, (t_inject - t_verify) * 1e3,
                        (t_load - t_inject) * 1e3, (t_end - t0) * 1e3)


async def restore_base_into(
    qmp: Any,
    pid: int,
    mem_path: str | os.PathLike[str],
    base: BaseImage,
    *,
    resume: bool = True,
    timeout_s: float = 60.0,
) -> float:
    """Start a fresh child from the base itself: QEMU ``pid`` spawned on ``base.mem_path``
    with share=off, ``-incoming defer -S`` loads the template stream. Returns milliseconds."""
    t0 = time.perf_counter()
    if os.path.realpath(mem_path) != os.path.realpath(base.mem_path):
        raise SnapshotMismatchError(f"the VM maps {mem_path}, not the base file {base.mem_path}")
    verify_base(base)
    status = (await qmp_execute(qmp, "query-status"))["status"]
    if status != "inmigrate":
        raise MemSnapError(f"VM {pid} is {status!r}: starting from a base needs -incoming defer")
    if find_vma(pid, mem_path).shared:
        raise MemSnapError(f"VM {pid} maps the base shared (share=on): it would write into the base")
    await load_device_state(qmp, base.template_path, timeout_s=timeout_s)
    if resume:
        await qmp_execute(qmp, "cont")
    return (time.perf_counter() - t0) * 1e3
