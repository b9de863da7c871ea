"""Device state of a VM as a QEMU migration stream, without its share=off RAM.

``xen-save-devices-state`` writes the CPU and device sections only (it skips every RAM and
iterative section), but it also drops the small ROM RAM blocks (``pc.bios``, fw_cfg blobs);
with ``-incoming`` QEMU never re-runs ``rom_reset``, so those would stay zero. The fix is to
splice the RAM sections of a *template* stream (``migrate`` with ``x-ignore-shared`` from the
share=on base VM: only the ROM blocks' pages are in it) in front of the xen device sections.

Stream layout (QEMU 7.2 and 10)::

    "QEVM" be32 3 | [configuration] | RAM sections | device FULL sections | EOF 0x00 |
    VMDESC 0x06 be32 len json

The configuration section (0x07, be32 len + machine type, then subsections 0x05: u8 len
idstr, be32 version, fields) is kept from the template: the loading VM checks it (machine
type, migration capabilities such as x-ignore-shared). QEMU 10.0 aborts when asked to
save with `migration.send-configuration=off`, so every stream carries one now.
Section headers: START 0x01 / FULL 0x04: be32 id, u8 len, idstr, be32 instance, be32 version;
COMMAND 0x08: be16 command, be16 length, data;
PART 0x02 / END 0x03: be32 id; each followed by its data and the footer 0x7e be32 id. RAM
section data are records ``be64 addr|flags``: MEM_SIZE 0x04 (+ block list: u8 len, idstr, be64
length, be64 addr with x-ignore-shared), ZERO 0x02 (+ [idstr] u8 fill), PAGE 0x08 (+ [idstr]
4096 bytes), CONTINUE 0x20 (no idstr), EOS 0x10 ends the section.

Files go to and from QEMU as file descriptors the host opened (`add-fd` / `getfd`), never
through a path QEMU opens or a helper it spawns: a jailed QEMU sees neither the snapshot
directories nor a shell (`-sandbox spawn=deny`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from .errors import CorruptSnapshotError, MemSnapError, UnsupportedStreamError

QEVM_MAGIC = 0x5145564D
QEVM_VERSION = 3
EOF_ = 0x00
SECTION_START = 0x01
SECTION_PART = 0x02
SECTION_END = 0x03
SECTION_FULL = 0x04
VMDESC = 0x06
CONFIGURATION = 0x07
SUBSECTION = 0x05
COMMAND = 0x08
FOOTER = 0x7E

RAM_FULL = 0x01
RAM_ZERO = 0x02
RAM_MEM_SIZE = 0x04
RAM_PAGE = 0x08
RAM_EOS = 0x10
RAM_CONTINUE = 0x20
RAM_XBZRLE = 0x40
RAM_HOOK = 0x80
RAM_COMPRESS = 0x100
TARGET_PAGE_SIZE = 4096
TARGET_PAGE_MASK = ~(TARGET_PAGE_SIZE - 1)


class _Reader:
    def __init__(self, buf: bytes, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise CorruptSnapshotError(f"{self.name}: truncated migration stream at offset {self.pos}")

    def u8(self) -> int:
        self.need(1)
        self.pos += 1
        return self.buf[self.pos - 1]

    def be16(self) -> int:
        self.need(2)
        self.pos += 2
        return int(struct.unpack_from(">H", self.buf, self.pos - 2)[0])

    def be32(self) -> int:
        self.need(4)
        self.pos += 4
        return int(struct.unpack_from(">I", self.buf, self.pos - 4)[0])

    def be64(self) -> int:
        self.need(8)
        self.pos += 8
        return int(struct.unpack_from(">Q", self.buf, self.pos - 8)[0])

    def take(self, n: int) -> bytes:
        self.need(n)
        self.pos += n
        return self.buf[self.pos - n : self.pos]


def _check_header(r: _Reader) -> None:
    if r.be32() != QEVM_MAGIC:
        raise CorruptSnapshotError(f"{r.name}: not a QEMU migration stream (bad magic)")
    v = r.be32()
    if v != QEVM_VERSION:
        raise UnsupportedStreamError(f"{r.name}: migration stream version {v}, expected {QEVM_VERSION}")
    if r.pos < len(r.buf) and r.buf[r.pos] == CONFIGURATION:
        _skip_configuration(r)


def _skip_configuration(r: _Reader) -> None:
    """Skip the configuration section and its subsections (vmstate_configuration)."""
    r.u8()
    r.take(r.be32())  # machine type
    while r.pos < len(r.buf) and r.buf[r.pos] == SUBSECTION:
        r.u8()
        idstr = r.take(r.u8())
        r.be32()  # version
        if idstr == b"configuration/capabilities":
            for _ in range(r.be32()):
                r.take(r.u8())
        elif idstr == b"configuration/target-page-bits":
            r.be32()
        elif idstr == b"configuration/uuid":
            r.take(16)
        else:
            raise UnsupportedStreamError(f"{r.name}: unknown configuration subsection {idstr!r}")


def _ram_section_data(r: _Reader) -> None:
    """Skip one RAM section's records up to and including EOS."""
    while True:
        rec = r.be64()
        flags = rec & ~TARGET_PAGE_MASK
        if flags & (RAM_XBZRLE | RAM_COMPRESS | RAM_HOOK):
            raise UnsupportedStreamError(f"{r.name}: RAM record flags {flags:#x} (xbzrle/compress/rdma)")
        if flags & RAM_MEM_SIZE:
            total = rec & TARGET_PAGE_MASK
            while total > 0:
                r.take(r.u8())  # idstr
                length = r.be64()
                r.be64()  # mr->addr, present because of x-ignore-shared
                if length <= 0 or length > total:
                    raise CorruptSnapshotError(f"{r.name}: bad RAM block list (length {length})")
                total -= length
        if flags & (RAM_ZERO | RAM_PAGE | RAM_FULL):
            if not flags & RAM_CONTINUE:
                r.take(r.u8())
            r.take(TARGET_PAGE_SIZE if flags & RAM_PAGE else 1)
        if flags & RAM_EOS:
            return


def _section_footer(r: _Reader, section_id: int) -> None:
    if r.u8() != FOOTER or r.be32() != section_id:
        raise CorruptSnapshotError(f"{r.name}: bad section footer at offset {r.pos}")


def parse_ram_prefix(stream: bytes, *, name: str = "template") -> int:
    """Offset where the RAM sections of a template stream end (the first device section).

    The stream must come from ``migrate`` with x-ignore-shared, without a configuration
    section. The bytes ``[0:offset]`` are the header plus all RAM sections.
    """
    r = _Reader(stream, name)
    _check_header(r)
    ram_ids: set[int] = set()
    while True:
        if r.pos >= len(stream):
            raise CorruptSnapshotError(f"{name}: truncated migration stream (no EOF)")
        kind = stream[r.pos]
        if kind in (SECTION_START, SECTION_FULL):
            save = r.pos
            r.u8()
            sid = r.be32()
            idstr = r.take(r.u8())
            r.be32(), r.be32()
            if idstr != b"ram":
                if kind == SECTION_START:
                    raise UnsupportedStreamError(f"{name}: iterative section {idstr!r} besides ram")
                if not ram_ids:
                    raise CorruptSnapshotError(f"{name}: no RAM section before device sections")
                return save
            ram_ids.add(sid)
            _ram_section_data(r)
            _section_footer(r, sid)
        elif kind in (SECTION_PART, SECTION_END):
            r.u8()
            sid = r.be32()
            if sid not in ram_ids:
                raise UnsupportedStreamError(f"{name}: PART/END of unknown section {sid}")
            _ram_section_data(r)
            _section_footer(r, sid)
        elif kind == COMMAND:
            # QEMU 10 sends MIG_CMD_SWITCHOVER_START between the RAM passes: kept with
            # them (the loading side only takes note of it)
            r.u8()
            r.be16()
            r.take(r.be16())
        elif kind == EOF_:
            if not ram_ids:
                raise CorruptSnapshotError(f"{name}: no RAM section in the template")
            return r.pos
        else:
            raise UnsupportedStreamError(f"{name}: unexpected section type {kind:#x} at offset {r.pos}")


def check_device_stream(stream: bytes, *, name: str = "device state") -> int:
    """Check an ``xen-save-devices-state`` file; return the offset of its first section."""
    r = _Reader(stream, name)
    _check_header(r)
    body = r.pos
    if len(stream) <= body or stream[-1] != EOF_:
        raise CorruptSnapshotError(f"{name}: truncated device state (no EOF marker)")
    if stream[body] != SECTION_FULL:
        raise CorruptSnapshotError(f"{name}: expected a device section, got type {stream[body]:#x}")
    r.u8()
    r.be32()
    idstr = r.take(r.u8())
    if idstr == b"ram":
        raise CorruptSnapshotError(f"{name}: contains RAM, not an xen-save-devices-state file")
    return body


_VMDESC_JSON = json.dumps({"page_size": TARGET_PAGE_SIZE, "devices": []}).encode()


def splice(template: bytes, devices: bytes, *, template_name: str = "template",
           devices_name: str = "device state") -> bytes:
    """Template header + RAM sections, then the device sections + EOF, then a small vmdesc."""
    ram_end = parse_ram_prefix(template, name=template_name)
    body = check_device_stream(devices, name=devices_name)
    vmdesc = bytes([VMDESC]) + struct.pack(">I", len(_VMDESC_JSON)) + _VMDESC_JSON
    return template[:ram_end] + devices[body:] + vmdesc


# ---- QMP sequences -------------------------------------------------------------------------


async def qmp_execute(qmp: Any, cmd: str, args: dict[str, object] | None = None) -> Any:
    """Run one QMP command, turning QMP errors into MemSnapError."""
    from qemu.qmp import QMPError

    try:
        return await qmp.execute(cmd, args) if args is not None else await qmp.execute(cmd)
    except (QMPError, OSError, EOFError) as exc:
        raise MemSnapError(f"QMP {cmd} failed: {type(exc).__name__}: {exc}") from exc


async def qemu_major(qmp: Any) -> int:
    """QEMU's major version (asked once per connection)."""
    cached = _MAJOR.get(qmp)
    if cached is None:
        info = await qmp_execute(qmp, "query-version")
        cached = _MAJOR[qmp] = int(info["qemu"]["major"])
    return cached


_MAJOR: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def fd_path(qmp: Any, fd: int, *, what: str) -> AsyncIterator[str]:
    """Lend QEMU `fd` (the caller keeps and closes its own copy) as a file-descriptor set;
    yields the path QEMU opens it by (`/dev/fdset/N`). The set is removed afterwards."""
    qmp.send_fd_scm(fd)
    info = await qmp_execute(qmp, "add-fd", {"opaque": what})
    fdset = int(info["fdset-id"])
    try:
        yield f"/dev/fdset/{fdset}"
    finally:
        with contextlib.suppress(MemSnapError):
            await qmp_execute(qmp, "remove-fd", {"fdset-id": fdset})


@contextlib.asynccontextmanager
async def migration_uri(qmp: Any, fd: int, *, what: str) -> AsyncIterator[str]:
    """A `migrate` / `migrate-incoming` URI over `fd`: `file:/dev/fdset/N` where QEMU has
    it (9.0+; `fd:` on a regular file is deprecated there), else `fd:NAME` (`getfd`)."""
    if await qemu_major(qmp) >= 9:
        async with fd_path(qmp, fd, what=what) as path:
            yield f"file:{path}"
        return
    qmp.send_fd_scm(fd)
    await qmp_execute(qmp, "getfd", {"fdname": "aenv-migration"})
    try:
        yield "fd:aenv-migration"
    finally:
        with contextlib.suppress(MemSnapError):
            await qmp_execute(qmp, "closefd", {"fdname": "aenv-migration"})


async def save_device_state(qmp: Any, path: str | os.PathLike[str]) -> None:
    """``xen-save-devices-state`` of a stopped VM to ``path`` (CPU + devices, no RAM),
    written through a descriptor opened here."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        async with fd_path(qmp, fd, what="device state") as qpath:
            await qmp_execute(qmp, "xen-save-devices-state", {"filename": qpath, "live": False})
    finally:
        os.close(fd)


async def enable_ignore_shared(qmp: Any) -> None:
    await qmp_execute(qmp, "migrate-set-capabilities",
                      {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})


async def wait_migration(qmp: Any, *, timeout_s: float = 60.0, what: str = "migration") -> None:
    """Poll ``query-migrate`` until completed; raise MemSnapError on failure or timeout."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        info = await qmp_execute(qmp, "query-migrate")
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise MemSnapError(f"{what} {status}: {info.get('error-desc', 'no details')}")
        if time.monotonic() > deadline:
            raise MemSnapError(f"{what} did not complete in {timeout_s} s (status {status})")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def save_template(qmp: Any, path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
    """``migrate`` a stopped share=on VM with x-ignore-shared to ``path`` (ROM pages + devices)."""
    await qmp_execute(qmp, "migrate-set-parameters", {"max-bandwidth": 100 << 30})
    await enable_ignore_shared(qmp)
    await migrate_to_file(qmp, path, timeout_s=timeout_s, what="template migration")


async def migrate_to_file(qmp: Any, path: str | os.PathLike[str], *, timeout_s: float,
                          what: str) -> None:
    """`migrate` into `path.part` through a descriptor opened here; renamed to `path` once
    QEMU reports the migration completed (it has written everything into the file)."""
    dest = os.fspath(path)
    part = dest + ".part"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dest)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        async with migration_uri(qmp, fd, what=what) as uri:
            await qmp_execute(qmp, "migrate", {"uri": uri})
            await wait_migration(qmp, timeout_s=timeout_s, what=what)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise
    finally:
        os.close(fd)
    os.rename(part, dest)


async def load_device_state(qmp: Any, path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
    """``migrate-incoming`` FILE (as a descriptor) into a ``-incoming defer`` VM; wait
    until loaded."""
    await enable_ignore_shared(qmp)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        async with migration_uri(qmp, fd, what="incoming state") as uri:
            await qmp_execute(qmp, "migrate-incoming", {"uri": uri})
            await _wait_loaded(qmp, path, timeout_s=timeout_s)
    finally:
        os.close(fd)


async def _wait_loaded(qmp: Any, path: str | os.PathLike[str], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        st = (await qmp_execute(qmp, "query-status"))["status"]
        if st in ("paused", "running", "postmigrate"):
            info = await qmp_execute(qmp, "query-migrate")
            if info.get("status") in (None, "completed"):
                return
        if st not in ("inmigrate", "prelaunch", "paused"):
            raise MemSnapError(f"loading {path} failed: VM status {st}")
        if time.monotonic() > deadline:
            raise MemSnapError(f"loading {path} did not finish in {timeout_s} s (status {st})")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
