"""The block server through real NBD clients (qemu-io, qemu-img) and a raw-socket client."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from host.storage.convert import convert_image
from host.storage.errors import (
    ControlError,
    LayerNotFoundError,
    StackExistsError,
    StackNotFoundError,
)

from .conftest import BlockServerProc, qemu_tool

MiB = 1 << 20


def qemu_io(uri: str, *cmds: str) -> str:
    argv = [qemu_tool("qemu-io"), "-f", "raw"]
    for c in cmds:
        argv += ["-c", c]
    r = subprocess.run([*argv, uri], check=False, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Pattern verification failed" not in out, out
    assert "error" not in out.lower(), out
    return out


def test_qemu_io_write_read_zero_discard(blockserver: BlockServerProc) -> None:
    blockserver.client.create("a", virtual_size=64 * MiB)
    uri = blockserver.uri("a")
    qemu_io(uri, "write -P 0xab 0 1M", "read -P 0xab 0 1M",
            "write -P 0xcd 4k 4k", "read -P 0xab 0 4k", "read -P 0xcd 4k 4k", "read -P 0xab 8k 1016k",
            "write -z 2M 1M", "read -P 0 2M 1M", "discard 0 64k", "read -P 0 0 64k",
            "write -P 0x11 63M 1M", "read -P 0x11 63M 1M", "read -P 0 4M 1M", "flush")
    # unaligned writes (qemu read-modify-writes to our 512-byte minimum)
    qemu_io(uri, "write -P 0x22 1000 3000", "read -P 0x22 1000 3000", "read -P 0 512 488")


def test_seal_clone_isolation_over_nbd(blockserver: BlockServerProc) -> None:
    c = blockserver.client
    c.create("base", virtual_size=16 * MiB)
    qemu_io(blockserver.uri("base"), "write -P 0x01 0 4M")
    d1 = c.seal("base")
    assert d1.startswith("sha256:")
    assert (blockserver.root.parent / "repo" / "layers" / f"{d1[7:]}.lsmt").exists()
    qemu_io(blockserver.uri("base"), "write -P 0x02 1M 1M")
    kids = [c.clone("base", f"kid{i}") for i in range(3)]
    assert len(kids[0].layers) == 2 and kids[0].layers[0] == d1
    for i, k in enumerate(kids):
        qemu_io(k.nbd_uri, f"write -P {0x10 + i} 0 512k")
    for i, k in enumerate(kids):
        qemu_io(k.nbd_uri, f"read -P {0x10 + i} 0 512k", "read -P 0x01 512k 512k",
                "read -P 0x02 1M 1M", "read -P 0x01 2M 2M")
    qemu_io(blockserver.uri("base"), "read -P 0x01 0 1M", "read -P 0x02 1M 1M")
    assert sorted(s.name for s in c.list()) == ["base", "kid0", "kid1", "kid2"]
    c.delete("kid1")
    with pytest.raises(StackNotFoundError):
        c.info("kid1")
    qemu_io(kids[2].nbd_uri, "read -P 0x12 0 512k")


def _ext4_image(tmp_path: Path, mib: int = 48) -> Path:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 not installed")
    tree = tmp_path / "tree"
    (tree / "usr" / "bin").mkdir(parents=True)
    for i in range(20):
        (tree / "usr" / "bin" / f"f{i}").write_bytes(os.urandom(300_000 + i * 1000))
    img = tmp_path / "rootfs.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(img), f"{mib}M"], check=True)
    return img


def test_qemu_img_convert_and_compare_through_nbd(blockserver: BlockServerProc,
                                                  tmp_path: Path) -> None:
    qemu_img = qemu_tool("qemu-img")
    img = _ext4_image(tmp_path)
    size = img.stat().st_size
    c = blockserver.client
    c.create("img", virtual_size=size)
    subprocess.run([qemu_img, "convert", "-n", "-f", "raw", "-O", "raw", str(img),
                    blockserver.uri("img")], check=True, timeout=120)
    subprocess.run([qemu_img, "compare", "-f", "raw", "-F", "raw", str(img),
                    blockserver.uri("img")], check=True, timeout=120)
    # the same image as a converted base layer, imported, with a stack on top
    out = tmp_path / "layers"
    out.mkdir()
    path, digest, _ = convert_image(img, out)
    assert c.import_layer(str(path)) == digest
    info = c.create("fromlayer", [digest])
    assert info.virtual_size == size
    subprocess.run([qemu_img, "compare", "-f", "raw", "-F", "raw", str(img), info.nbd_uri],
                   check=True, timeout=120)
    # a whole-image copy out through NBD is byte-identical too
    copy = tmp_path / "copy.raw"
    subprocess.run([qemu_img, "convert", "-f", "raw", "-O", "raw", info.nbd_uri, str(copy)],
                   check=True, timeout=120)
    assert copy.read_bytes() == img.read_bytes()


def test_export_raw_writes_what_the_stack_reads_as_a_sparse_file(
        blockserver: BlockServerProc, tmp_path: Path) -> None:
    img = _ext4_image(tmp_path)
    size = img.stat().st_size
    out = tmp_path / "layers"
    out.mkdir()
    path, digest, _ = convert_image(img, out)
    c = blockserver.client
    c.import_layer(str(path))
    info = c.create("exp", [digest])
    # over the layer: data written, and a block of it zeroed
    qemu_io(info.nbd_uri, "write -P 0x5a 1M 64k", "write -z 0 4k")
    exported = tmp_path / "export.raw"
    written = c._call("export_raw", name="exp", path=str(exported))["bytes"]
    expect = bytearray(img.read_bytes())
    expect[1 * MiB:1 * MiB + 65536] = b"\x5a" * 65536
    expect[0:4096] = bytes(4096)
    assert exported.read_bytes() == bytes(expect)
    st = exported.stat()
    assert st.st_size == size and st.st_blocks * 512 < size // 4  # holes, not zeros
    assert written < size // 4 and stat.S_IMODE(st.st_mode) == 0o600
    with pytest.raises(ControlError, match="exists"):  # never over an existing file
        c._call("export_raw", name="exp", path=str(exported))


def test_stacks_survive_block_server_sigkill(blockserver: BlockServerProc) -> None:
    c = blockserver.client
    c.create("p", virtual_size=8 * MiB)
    qemu_io(blockserver.uri("p"), "write -P 0x33 0 2M", "flush")
    d = c.seal("p", upload=False)
    qemu_io(blockserver.uri("p"), "write -P 0x44 1M 512k", "flush")
    c.clone("p", "q")
    qemu_io(blockserver.uri("q"), "write -P 0x55 0 4k", "flush")
    blockserver.restart(graceful=False)  # SIGKILL
    c = blockserver.client
    assert {s.name for s in c.list()} == {"p", "q"}
    assert c.info("p").layers[0] == d
    qemu_io(blockserver.uri("p"), "read -P 0x33 0 1M", "read -P 0x44 1M 512k",
            "read -P 0x33 1536k 512k")
    qemu_io(blockserver.uri("q"), "read -P 0x55 0 4k", "read -P 0x33 4k 1020k",
            "read -P 0x44 1M 512k")


def test_control_errors_leave_server_up(blockserver: BlockServerProc) -> None:
    c = blockserver.client
    c.create("x", virtual_size=MiB)
    with pytest.raises(StackExistsError):
        c.create("x", virtual_size=MiB)
    with pytest.raises(LayerNotFoundError):
        c.create("y", ["sha256:" + "0" * 64])
    with pytest.raises(ControlError, match="bad stack name"):
        c.create("../evil", virtual_size=MiB)
    with pytest.raises(ControlError, match="virtual_size"):
        c.create("z", virtual_size=1000)
    with pytest.raises(StackNotFoundError):
        c.seal("nope")
    with pytest.raises(ControlError, match="unknown op"):
        c._call("frobnicate")
    with socket.socket(socket.AF_UNIX) as s:  # garbage on the control socket
        s.connect(str(blockserver.socket_dir / "control.sock"))
        s.sendall(b"{not json\n")
        assert b'"ok": false' in s.recv(4096)
    assert c.ping() and blockserver.alive()


# --- a tiny raw NBD client, to send what qemu never would ---

class RawNbd:
    def __init__(self, path: Path) -> None:
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(10)
        self.s.connect(str(path))
        magic, opt, flags = struct.unpack(">QQH", self.recv(18))
        assert magic == 0x4E42444D41474943 and opt == 0x49484156454F5054 and flags & 1
        self.s.sendall(struct.pack(">I", 3))

    def recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    def option(self, opt: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        self.s.sendall(struct.pack(">QII", 0x49484156454F5054, opt, len(data)) + data)
        replies = []
        while True:
            magic, ropt, rtype, length = struct.unpack(">QIII", self.recv(20))
            assert magic == 0x3E889045565A9 and ropt == opt
            replies.append((rtype, self.recv(length)))
            if rtype != 2 and rtype != 3:  # not SERVER/INFO: final reply
                return replies

    def go(self, name: str) -> int:
        raw = name.encode()
        replies = self.option(7, struct.pack(">I", len(raw)) + raw + struct.pack(">H", 0))
        assert replies[-1][0] == 1, replies
        info = next(d for t, d in replies if t == 3 and d[:2] == b"\x00\x00")
        size: int = struct.unpack(">Q", info[2:10])[0]
        return size

    def request(self, cmd: int, offset: int, length: int, data: bytes = b"",
                handle: int = 7) -> tuple[int, bytes]:
        self.s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, cmd, handle, offset, length) + data)
        magic, err, h = struct.unpack(">IIQ", self.recv(16))
        assert magic == 0x67446698 and h == handle
        payload = self.recv(length) if cmd == 0 and err == 0 else b""
        return err, payload

    def close(self) -> None:
        self.s.close()


def test_nbd_bad_requests_get_errors_and_server_stays_up(blockserver: BlockServerProc) -> None:
    c = blockserver.client
    c.create("good", virtual_size=4 * MiB)
    c.create("victim", virtual_size=4 * MiB)
    qemu_io(blockserver.uri("victim"), "write -P 0x77 0 4M")

    n = RawNbd(blockserver.nbd_socket)
    # LIST, INFO on an unknown export, unsupported option
    names = [d[4:].decode() for t, d in n.option(3) if t == 2]
    assert names == ["good", "victim"]
    unknown = n.option(6, struct.pack(">I", 4) + b"nope" + struct.pack(">H", 0))
    assert unknown[-1][0] == (1 << 31) + 6
    assert n.option(99)[-1][0] == (1 << 31) + 1
    assert n.option(7, b"\x00\x00")[-1][0] == (1 << 31) + 3  # malformed GO
    size = n.go("good")
    assert size == 4 * MiB
    # past the end: EINVAL, connection still usable
    assert n.request(0, size - 512, 1024)[0] == errno.EINVAL
    assert n.request(0, 2**63, 512)[0] == errno.EINVAL
    assert n.request(1, size, 512, b"w" * 512)[0] == errno.EINVAL  # payload drained
    assert n.request(6, size - 4096, 8192)[0] == errno.EINVAL
    assert n.request(4, size + 4096, 4096)[0] == errno.EINVAL
    assert n.request(0, 0, 64 * MiB)[0] == errno.EINVAL  # over the max request size
    assert n.request(42, 0, 0)[0] == errno.EINVAL  # unknown command
    # good requests still work on the same connection, unaligned ones too
    assert n.request(1, 100, 3, b"abc") == (0, b"")
    assert n.request(0, 0, 512) == (0, bytes(100) + b"abc" + bytes(409))
    assert n.request(1, 4 * MiB - 512, 512, b"e" * 512) == (0, b"")
    assert n.request(3, 0, 0) == (0, b"")
    assert n.request(0, 4 * MiB - 1024, 1024) == (0, bytes(512) + b"e" * 512)
    big = n.request(0, 0, 2 * MiB)
    assert big[0] == 0 and len(big[1]) == 2 * MiB
    n.s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 2, 1, 0, 0))  # DISC: no reply
    n.close()

    # garbage: wrong request magic and a cut handshake close only that connection
    g = RawNbd(blockserver.nbd_socket)
    g.go("good")
    g.s.sendall(b"\xde\xad\xbe\xef" * 7)
    with pytest.raises((EOFError, ConnectionError)):
        g.recv(16)
    g.close()
    h = socket.socket(socket.AF_UNIX)
    h.connect(str(blockserver.nbd_socket))
    h.sendall(b"\x00")
    h.close()
    a = RawNbd(blockserver.nbd_socket)
    assert a.option(2)[-1][0] == 1  # ABORT is acknowledged
    a.close()

    assert blockserver.alive()
    qemu_io(blockserver.uri("victim"), "read -P 0x77 0 4M")
    qemu_io(blockserver.uri("good"), f"read -P 0x65 {4 * MiB - 512} 512")


def test_concurrent_clients_on_one_export(blockserver: BlockServerProc) -> None:
    """Several connections (QEMU multi-conn style) write disjoint regions at once."""
    blockserver.client.create("mc", virtual_size=32 * MiB)
    uri = blockserver.uri("mc")
    procs = [subprocess.Popen([qemu_tool("qemu-io"), "-f", "raw",
                               "-c", f"aio_write -P {0x40 + i} {i * 4}M 4M",
                               "-c", "aio_flush", "-c", f"write -P {0x50 + i} {i * 4 + 1}M 64k",
                               uri], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(6)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    for i in range(6):
        qemu_io(uri, f"read -P {0x40 + i} {i * 4}M 1M", f"read -P {0x50 + i} {i * 4 + 1}M 64k",
                f"read -P {0x40 + i} {i * 4 * 1024 + 1024 + 64}k {3 * 1024 - 64}k")
