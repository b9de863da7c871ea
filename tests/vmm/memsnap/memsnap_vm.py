"""A small QEMU microVM launcher for memsnap tests and bench (not the project driver).

The guest is the project kernel plus a read-only ext4 root with busybox (the kernel has no
initramfs support): /init mounts a tmpfs on /data and runs a shell on ttyS0, which the host
drives over the serial chardev's unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from qemu.qmp import ConnectError, QMPClient

from host.vmm.memsnap import config_digest
from host.vmm.qemu.cmdline import MACHINE

AENV_CACHE = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))
QEMU = "qemu-system-x86_64"

INIT = """#!/bin/sh
export PATH=/bin PS1= PS2=
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs -o size=200M tmpfs /data
stty -echo
echo @@BOOTED
# a non-interactive shell fed through a pipe: no prompt, no line editing, no echo
cat | sh
"""


# With this kernel under TCG the guest 8250 sees no RX FIFO timeout interrupt: the last bytes
# (< FIFO trigger level) of a write stay in the UART until more input comes. Empty lines after
# each command push the command's own newline through; the shell ignores them.
_PAD = b"\n" * 16


def find_kernel() -> Path | None:
    """The newest finished project kernel (``kernel/build.sh`` output), if any."""
    cur = AENV_CACHE / "kernel" / "current" / "vmlinux"
    if cur.exists() and (cur.parent / "DONE").exists():
        return cur.resolve()
    done = [Path(p) for p in glob.glob(str(AENV_CACHE / "kernel" / "*" / "vmlinux"))
            if (Path(p).parent / "DONE").exists()]
    return max(done, key=lambda p: p.stat().st_mtime) if done else None


def build_rootfs(dest: Path) -> Path:
    """An ext4 image with static busybox and /init; returns the image path."""
    root = dest / "rootfs"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    for d in ("proc", "sys", "dev", "data", "tmp"):
        (root / d).mkdir(exist_ok=True)
    bb = root / "bin" / "busybox"
    bb.write_bytes(Path("/usr/bin/busybox").read_bytes())
    bb.chmod(0o755)
    applets = subprocess.run([str(bb), "--list"], capture_output=True, text=True, check=True).stdout
    for a in applets.split():
        if a != "busybox" and not (root / "bin" / a).exists():
            (root / "bin" / a).symlink_to("busybox")
    (root / "init").write_text(INIT)
    (root / "init").chmod(0o755)
    img = dest / "root.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(root), str(img), "16M"], check=True,
                   capture_output=True)
    return img


def tsc_khz() -> int:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return round(float(line.split(":")[1]) * 1000)
    return 0


@dataclass(frozen=True)
class VmShape:
    """What every VM of one snapshot family shares (identical QEMU configuration)."""

    kernel: Path
    rootfs: Path
    mem_mib: int = 256

    def argv(self, *, mem_path: Path, share: bool, workdir: Path, incoming: bool) -> list[str]:
        append = (f"console=ttyS0 panic=-1 tsc_early_khz={tsc_khz()} quiet loglevel=1 "
                  "cryptomgr.notests root=/dev/vda ro rootfstype=ext4 init=/init")
        argv = [
            QEMU, "-M", MACHINE, "-accel", "tcg", "-cpu", "max", "-smp", "1",
            "-m", f"{self.mem_mib}M", "-display", "none", "-no-reboot", "-nodefaults",
            "-object", (f"memory-backend-file,id=mem0,size={self.mem_mib}M,mem-path={mem_path},"
                        f"share={'on' if share else 'off'},merge=off"),
            "-machine", "memory-backend=mem0",
            "-kernel", str(self.kernel), "-append", append,
            "-drive", f"file={self.rootfs},format=raw,if=none,id=root,readonly=on",
            "-device", "virtio-blk-device,drive=root",
            "-chardev", f"socket,id=con,path={workdir / 'con.sock'},server=on,wait=off",
            "-serial", "chardev:con",
            "-qmp", f"unix:{workdir / 'qmp.sock'},server=on,wait=off",
        ]
        if incoming:
            argv += ["-incoming", "defer", "-S"]
        return argv

    def config_sha256(self) -> bytes:
        """Digest of the child configuration, without per-instance socket paths."""
        argv = self.argv(mem_path=Path("BASE"), share=False, workdir=Path("WORK"), incoming=True)
        return config_digest(argv)


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    """Start QEMU in its own session; setpriv's PR_SET_PDEATHSIG (kept across exec) kills it
    if the test process dies, so no QEMU outlives a crashed test."""
    with open(log, "wb") as err:
        return subprocess.Popen(["setpriv", "--pdeathsig", "KILL", "--", *argv],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                start_new_session=True)


def make_sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


class Vm:
    """One QEMU process with its QMP client and serial shell. ``kill()`` is idempotent."""

    def __init__(self, argv: list[str], workdir: Path, mem_path: Path) -> None:
        self.argv, self.workdir, self.mem_path = argv, workdir, mem_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.qmp = QMPClient()  # unnamed: a named client is a logger kept for the process life
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self._n = 0
        self.timings: dict[str, float] = {}
        self.t_spawn = 0.0  # perf_counter() at Popen

    @classmethod
    async def start(cls, shape: VmShape, workdir: Path, *, mem_path: Path, share: bool,
                    incoming: bool, timeout_s: float = 30.0) -> Vm:
        workdir.mkdir(parents=True, exist_ok=True)
        for s in ("qmp.sock", "con.sock"):
            (workdir / s).unlink(missing_ok=True)
        vm = cls(shape.argv(mem_path=mem_path, share=share, workdir=workdir, incoming=incoming),
                 workdir, mem_path)
        t0 = time.perf_counter()
        vm.proc = _spawn(vm.argv, workdir / "qemu.stderr")
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if vm.proc.poll() is not None:
                    raise RuntimeError(f"QEMU exited {vm.proc.returncode}: {vm.stderr()}")
                if (workdir / "qmp.sock").exists():
                    try:
                        await vm.qmp.connect(str(workdir / "qmp.sock"))
                        break
                    except (OSError, ConnectError):  # socket file exists before listen()
                        pass
                if time.monotonic() > deadline:
                    raise TimeoutError("QMP socket did not come up")
                await asyncio.sleep(0.005)
            vm.timings["spawn_to_qmp_ms"] = (time.perf_counter() - t0) * 1e3
            await vm.qmp.execute("migrate-set-parameters", {"max-bandwidth": 100 << 30})
        except BaseException:
            await vm.kill()
            raise
        vm.t_spawn = t0
        return vm

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr(self) -> str:
        try:
            return (self.workdir / "qemu.stderr").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    async def console(self) -> None:
        if self._r is None:
            self._r, self._w = await asyncio.open_unix_connection(str(self.workdir / "con.sock"))

    async def wait_shell(self, timeout_s: float = 60.0) -> float:
        """Poke the shell until it answers; returns seconds waited."""
        await self.console()
        assert self._r is not None and self._w is not None
        t0 = time.perf_counter()
        buf = b""
        while True:
            self._w.write(b"echo @@RE''ADY\n" + _PAD)
            await self._w.drain()
            try:
                while b"@@READY" not in buf:
                    buf += await asyncio.wait_for(self._r.read(4096), 0.5)
                waited = time.perf_counter() - t0
                await self.sh("true")  # consume the answers to earlier pokes
                return waited
            except TimeoutError:
                pass
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"guest shell did not answer: {buf[-500:]!r} {self.stderr()}")

    async def sh(self, cmd: str, timeout_s: float = 120.0) -> str:
        """Run ``cmd`` in the guest shell; return its output; raise if it exits non-zero."""
        await self.console()
        assert self._r is not None and self._w is not None
        self._n += 1
        self._w.write(f"{cmd}; echo @@EN''D{self._n} $?\n".encode() + _PAD)
        await self._w.drain()
        pat = re.compile(rb"@@END%d (\d+)" % self._n)
        buf = b""
        async with asyncio.timeout(timeout_s):
            while not (m := pat.search(buf)):
                chunk = await self._r.read(65536)
                if not chunk:
                    raise EOFError(f"console closed: {buf[-500:]!r}")
                buf += chunk
        out = buf[: m.start()].decode(errors="replace").replace("\r", "")
        out = "\n".join(ln for ln in out.split("\n") if "@@READY" not in ln)
        if m.group(1) != b"0":
            raise RuntimeError(f"guest command {cmd!r} failed ({m.group(1).decode()}): {out}")
        return out.strip()

    async def kill(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = self._r = None
        with contextlib.suppress(Exception):  # best effort: the process is killed anyway
            await self.qmp.disconnect()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)


def smaps_rollup(pid: int) -> dict[str, int]:
    """Fields of /proc/PID/smaps_rollup in KiB."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def file_md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()
