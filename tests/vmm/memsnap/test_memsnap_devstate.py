"""Splicing device state: template RAM sections + xen device sections (synthetic streams)."""

from __future__ import annotations

import struct

import pytest

from host.vmm.memsnap import (
    CorruptSnapshotError,
    UnsupportedStreamError,
    check_device_stream,
    parse_ram_prefix,
    splice,
)

HDR = struct.pack(">II", 0x5145564D, 3)


def be32(x: int) -> bytes:
    return struct.pack(">I", x)


def be64(x: int) -> bytes:
    return struct.pack(">Q", x)


def section_start(kind: int, sid: int, name: bytes, inst: int = 0, ver: int = 4) -> bytes:
    return bytes([kind]) + struct.pack(">I", sid) + bytes([len(name)]) + name + struct.pack(">II", inst, ver)


def footer(sid: int) -> bytes:
    return b"\x7e" + struct.pack(">I", sid)


def ram_sections(page: bytes = b"\xab" * 4096) -> bytes:
    blocks = [(b"mem0", 256 << 20, 0), (b"pc.bios", 64 << 10, 0xFFFF0000)]
    total = sum(length for _, length, _ in blocks)
    setup = be64(total | 0x04)
    for name, length, addr in blocks:
        setup += bytes([len(name)]) + name + be64(length) + be64(addr)
    setup += be64(0x10)
    part = (be64(0xF000 | 0x08) + bytes([7]) + b"pc.bios" + page  # PAGE with block name
            + be64(0xE000 | 0x02 | 0x20) + b"\x00"  # ZERO, CONTINUE
            + be64(0x10))
    end = be64(0xD000 | 0x08 | 0x20) + page + be64(0x10)
    return (section_start(1, 2, b"ram") + setup + footer(2)
            + bytes([2]) + struct.pack(">I", 2) + part + footer(2)
            + bytes([3]) + struct.pack(">I", 2) + end + footer(2))


def devices(*names: bytes) -> bytes:
    out = b""
    for n, name in enumerate(names):
        out += section_start(4, 10 + n, name) + b"opaque-device-bytes\x00\x7e" + footer(10 + n)
    return out


def template() -> bytes:
    vmdesc = b'{"page_size":4096,"devices":[]}'
    return (HDR + ram_sections() + devices(b"timer", b"cpu") + b"\x00"
            + b"\x06" + struct.pack(">I", len(vmdesc)) + vmdesc)


def xen() -> bytes:
    return HDR + devices(b"timer", b"cpu", b"serial") + b"\x00"


def test_ram_prefix_ends_at_the_first_device_section() -> None:
    t = template()
    end = parse_ram_prefix(t)
    assert end == len(HDR) + len(ram_sections())
    assert t[end] == 0x04


def test_splice_is_template_ram_plus_xen_devices_plus_vmdesc() -> None:
    out = splice(template(), xen())
    prefix = HDR + ram_sections()
    assert out.startswith(prefix)
    rest = out[len(prefix):]
    body = xen()[8:]
    assert rest.startswith(body)
    vm = rest[len(body):]
    assert vm[0] == 0x06
    (n,) = struct.unpack(">I", vm[1:5])
    assert len(vm) == 5 + n and vm[5:].startswith(b"{")


@pytest.mark.parametrize(
    "stream, err, match",
    [
        (b"XXXX" + template()[4:], CorruptSnapshotError, "bad magic"),
        (struct.pack(">II", 0x5145564D, 2) + template()[8:], UnsupportedStreamError, "version"),
        (HDR + b"\x07" + struct.pack(">I", 4) + b"pc-q" + b"\x05\x0bconfig/what" + be32(1)
         + template()[8:], UnsupportedStreamError, "unknown configuration subsection"),
        (template()[:60], CorruptSnapshotError, "truncated"),
        (HDR + devices(b"cpu") + b"\x00", CorruptSnapshotError, "no RAM section"),
        (HDR + section_start(1, 2, b"ram") + be64(0x40) + footer(2), UnsupportedStreamError, "xbzrle"),
        (HDR + section_start(1, 2, b"block") + be64(0x10), UnsupportedStreamError, "iterative"),
    ],
)
def test_bad_templates(stream: bytes, err: type[Exception], match: str) -> None:
    with pytest.raises(err, match=match):
        parse_ram_prefix(stream)


def test_bad_device_streams() -> None:
    assert check_device_stream(xen()) == 8
    with pytest.raises(CorruptSnapshotError, match="EOF"):
        check_device_stream(xen()[:-1])
    with pytest.raises(CorruptSnapshotError, match="expected a device section"):
        check_device_stream(HDR + ram_sections() + b"\x00")
    with pytest.raises(CorruptSnapshotError, match="truncated"):
        check_device_stream(HDR + b"\x07" + xen()[8:])  # a configuration cut short
    with pytest.raises(CorruptSnapshotError, match="contains RAM"):
        check_device_stream(HDR + section_start(4, 1, b"ram") + b"\x00")


def configuration(machine: bytes = b"microvm", caps: tuple[bytes, ...] = (b"x-ignore-shared",)
                  ) -> bytes:
    """A configuration section as QEMU 10 writes it (machine type, capabilities)."""
    sub = b"configuration/capabilities"
    body = b"".join(bytes([len(c)]) + c for c in caps)
    return (b"\x07" + be32(len(machine)) + machine + b"\x05" + bytes([len(sub)]) + sub
            + be32(1) + be32(len(caps)) + body)


def test_streams_with_a_configuration_section_splice_keeping_the_templates() -> None:
    """QEMU 10 aborts saving with send-configuration=off: every stream has one. The
    spliced stream keeps the template's (what the loading VM checks), drops the xen one's."""
    tmpl = HDR + configuration() + template()[8:]
    devs = HDR + configuration(caps=()) + xen()[8:]
    out = splice(tmpl, devs)
    assert out.startswith(HDR + configuration())
    assert out.count(b"configuration/capabilities") == 1
    assert out[: parse_ram_prefix(tmpl)] == tmpl[: parse_ram_prefix(tmpl)]
    assert check_device_stream(devs) == len(HDR + configuration(caps=()))
