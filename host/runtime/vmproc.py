"""One QEMU process of a snapshot family, as the runtime runs it.

The project driver (host/vmm/qemu.py) boots and restores whole-RAM snapshots; memory
snapshots (host/vmm/memsnap) need QEMU started with `-incoming defer -S` and no state
file, `merge=off` on the memory backend, and a process that can outlive the host service
(adopt). So the runtime spawns QEMU itself from the driver's pure argv builder
(`host.vmm.qemu_cmdline.build_argv`) and drives it over its own QMP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from host.vmm.driver import MemoryBacking, TapNet, UserNet, VmSpec
from host.vmm.memsnap import config_digest
from host.vmm.proc import die_with_parent, tail
from host.vmm.qemu_cmdline import QemuRunFiles, build_argv
from host.vmm.readiness import wait_for_health

from .errors import SandboxStartError

log = logging.getLogger(__name__)

_QMP_READY_S = 15.0


def family_argv(spec: VmSpec, *, files: QemuRunFiles, accel: str, tsc_khz: int | None,
                host_port: int | None, incoming: bool, qemu: str) -> list[str]:
    """The driver's argv plus what memsnap needs on every VM of a family: `merge=off` on
    the memory backend and `-S` next to `-incoming defer`."""
    argv = build_argv(spec, files=files, accel=accel, tsc_khz=tsc_khz, host_port=host_port,
                      incoming=incoming, qemu=qemu)
    for i, a in enumerate(argv):
        if a.startswith("memory-backend-file,") and "merge=" not in a:
            argv[i] = a + ",merge=off"
    if incoming:
        argv.append("-S")
    return argv


def family_digest(spec: VmSpec, *, accel: str, tsc_khz: int | None, qemu: str) -> bytes:
    """config_sha256 of a family: the argv with per-instance parts normalised (paths,
    sockets, ports, namespace, share=, -incoming)."""
    mem = spec.memory
    canon = VmSpec(
        kernel=spec.kernel, cmdline=spec.cmdline, vcpus=spec.vcpus, mem_mib=spec.mem_mib,
        initrd=spec.initrd, disks=spec.disks,
        network=(TapNet(tap=spec.network.tap, guest_ip=spec.network.guest_ip, netns=None,
                        mac=spec.network.mac) if isinstance(spec.network, TapNet)
                 else spec.network),
        memory=MemoryBacking(path=Path("/MEM"), shared=False) if mem is not None else None,
        name="vm")
    argv = family_argv(canon, files=QemuRunFiles.in_dir(Path("/WORK")), accel=accel,
                       tsc_khz=tsc_khz, host_port=0, incoming=True, qemu=qemu)
    out: list[str] = []
    for a in argv:
        if a.startswith("file.driver=nbd") or "file.export=" in a:
            a = ",".join(p for p in a.split(",") if not p.startswith(("file.export=",
                                                                      "file.server.path=")))
        if a.startswith("user,id=net0"):
            a = "user,id=net0"
        out.append(a)
    return config_digest(out)


def pid_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child is "alive" for kill(0) but gone for us
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def qemu_pids_under(vms_dir: Path) -> dict[int, str]:
    """{pid: sandbox id} of every QEMU (or its `ip netns exec` wrapper before the exec)
    whose QMP socket lies in `vms_dir/<sandbox id>/`: finds VMs whose pid was never
    recorded (a service killed between spawn and the pid file)."""
    prefix = f"unix:{vms_dir}/"
    found: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = pid_cmdline(int(d.name))
        if not argv or not ("qemu-system" in argv[0] or argv[0] in ("ip", "/usr/sbin/ip",
                                                                     "/sbin/ip")):
            continue
        for a in argv:
            if a.startswith(prefix) and "/qmp.sock" in a:
                found[int(d.name)] = a[len(prefix):].split("/", 1)[0]
                break
    return found


def is_our_qemu(pid: int, qmp_socket: Path) -> bool:
    """Whether `pid` is a QEMU whose command line names `qmp_socket` (pids get reused)."""
    argv = pid_cmdline(pid)
    return (bool(argv) and any("qemu-system" in a for a in argv[:1])
            and any(str(qmp_socket) in a for a in argv))


class QemuProcess:
    """A QEMU process (spawned here, or adopted by pid) and its QMP client."""

    def __init__(self, *, name: str, work_dir: Path, pid: int,
                 proc: asyncio.subprocess.Process | None, argv: list[str]) -> None:
        self.name = name
        self.work_dir = work_dir
        self.pid = pid
        self.proc = proc
        self.argv = argv
        self.qmp: QMPClient | None = None
        self.qmp_ready_s: float | None = None
        self.killed = False

    @property
    def files(self) -> QemuRunFiles:
        return QemuRunFiles.in_dir(self.work_dir)

    @property
    def serial_log(self) -> Path:
        return self.files.serial_log

    @property
    def stderr_log(self) -> Path:
        return self.work_dir / "qemu.stderr"

    def tails(self) -> str:
        return (f"serial tail:\n{tail(self.serial_log, 20)}\n"
                f"qemu stderr:\n{tail(self.stderr_log, 20)}")

    def alive(self) -> bool:
        if self.proc is not None and self.proc.returncode is not None:
            return False
        return pid_alive(self.pid)  # also False for a zombie not reaped yet

    # -- start ------------------------------------------------------------------------

    @classmethod
    async def spawn(cls, argv: list[str], *, name: str, work_dir: Path,
                    die_with_service: bool) -> QemuProcess:
        """Start QEMU in its own session and connect QMP; kills it on any failure."""
        work_dir.mkdir(parents=True, exist_ok=True)
        files = QemuRunFiles.in_dir(work_dir)
        files.qmp_socket.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(work_dir / "qemu.stderr", "wb") as err:  # noqa: ASYNC230 - local, instant
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=err, start_new_session=True,
                    preexec_fn=die_with_parent if die_with_service else None)
            except OSError as exc:
                raise SandboxStartError(f"{name}: cannot run {argv[0]}: {exc}") from exc
        vm = cls(name=name, work_dir=work_dir, pid=proc.pid, proc=proc, argv=argv)
        # recorded at once: a service killed during the QMP wait leaves a findable VM
        (work_dir / "pid").write_text(str(proc.pid))
        try:
            await vm.connect(timeout_s=_QMP_READY_S)
        except BaseException:
            await vm.kill()
            raise
        vm.qmp_ready_s = time.perf_counter() - t0
        return vm

    @classmethod
    async def adopt(cls, *, name: str, pid: int, work_dir: Path) -> QemuProcess | None:
        """Re-attach to a running QEMU (None if `pid` is not that QEMU any more)."""
        files = QemuRunFiles.in_dir(work_dir)
        if not pid_alive(pid) or not is_our_qemu(pid, files.qmp_socket):
            return None
        vm = cls(name=name, work_dir=work_dir, pid=pid, proc=None, argv=pid_cmdline(pid))
        try:
            await vm.connect(timeout_s=5.0)
        except SandboxStartError:
            return None
        return vm

    async def connect(self, *, timeout_s: float) -> None:
        sock_path = self.files.qmp_socket
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise SandboxStartError(f"{self.name}: QEMU exited during startup\n{self.tails()}")
            if sock_path.exists():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    await asyncio.get_running_loop().sock_connect(s, str(sock_path))
                except OSError:
                    s.close()
                else:
                    client = QMPClient(self.name)
                    try:
                        await asyncio.wait_for(client.connect(s), 5.0)
                    except Exception:  # noqa: BLE001 - retried until the deadline
                        with contextlib.suppress(Exception):
                            await client.disconnect()
                        s.close()
                    else:
                        self.qmp = client
                        return
            if time.monotonic() > deadline:
                raise SandboxStartError(f"{self.name}: QMP did not answer within {timeout_s}s\n"
                                        f"{self.tails()}")
            await asyncio.sleep(0.005)

    # -- control ----------------------------------------------------------------------

    async def execute(self, cmd: str, args: dict[str, Any] | None = None,
                      timeout_s: float = 10.0) -> Any:
        if self.qmp is None:
            raise SandboxStartError(f"{self.name}: no QMP connection")
        return await asyncio.wait_for(self.qmp.execute(cmd, args), timeout_s)

    async def status(self) -> str:
        return str((await self.execute("query-status"))["status"])

    async def wait_for_envd(self, url: str, timeout_s: float) -> float:
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                await wait_for_health(url, alive=self.alive)
        except TimeoutError:
            raise SandboxStartError(f"{self.name}: envd did not answer {url}/health within "
                                    f"{timeout_s:g}s\n{self.tails()}") from None
        if not self.alive():
            raise SandboxStartError(f"{self.name}: QEMU exited before envd answered\n"
                                    f"{self.tails()}")
        return time.perf_counter() - t0

    # -- teardown ---------------------------------------------------------------------

    async def disconnect(self) -> None:
        if self.qmp is not None:
            with contextlib.suppress(Exception):
                await self.qmp.disconnect()
            self.qmp = None

    async def kill(self, *, grace_s: float = 2.0) -> None:
        """Quit QEMU (QMP quit, then SIGKILL of its process group) and reap it. Idempotent."""
        if self.killed:
            return
        if self.alive() and self.qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.qmp.execute("quit"), 1.0)
        deadline = time.monotonic() + grace_s
        while self.alive() and time.monotonic() < deadline:
            if self.proc is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.proc.wait(), 0.05)
            else:
                await asyncio.sleep(0.02)
        if self.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while self.alive() and time.monotonic() < deadline:
                if self.proc is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.proc.wait(), 0.05)
                else:
                    await asyncio.sleep(0.02)
        # exec: migration helpers (cat) of its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        await self.disconnect()
        self.files.qmp_socket.unlink(missing_ok=True)
        self.killed = True


def user_net(port: int) -> UserNet:
    return UserNet(host_port=port)
