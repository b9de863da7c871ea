"""A QEMU VM: one `QemuVm` per QEMU process, controlled over QMP (made by `QemuDriver`).

A `QemuVm` owns the QEMU process (its own session/process group), the QMP connection,
the work dir (QMP socket, serial log, QEMU stderr) and the forwarded host port. Every
failure path goes through `kill()`, which leaves no process and no file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from qemu.qmp import ExecuteError, QMPClient, QMPError

from .. import proc as procs
from .. import procscan
from ..driver import BalloonStats, BootTimeouts, TapNet, UserNet, VmSpec, VmState
from ..errors import VmmError, VmmStartError, VmmStateError, VmmTimeout
from ..jail import Jail, JailConfig, UidPool
from ..vmbase import TAIL_LINES, VmBase, VmHost
from . import balloon as qemu_balloon
from . import memory as qemu_memory
from . import migration as qemu_migration
from .binds import jail_binds
from .cmdline import QemuRunFiles, build_argv
from .migration import MIGRATE_S
from .preload import preload_env

if TYPE_CHECKING:
    from ..memsnap import BaseImage, MemSnapshot

log = logging.getLogger(__name__)

_PORT_ATTEMPTS = 5
_QMP_CALL_S = 10.0


class _PortTaken(Exception):
    """QEMU could not bind the forwarded host port (someone took it after we picked it)."""


class QemuHost(VmHost, Protocol):
    """What a QEMU VM uses of the driver that made it (`QemuDriver`; named instead of it,
    so this module need not import the driver's)."""

    qemu: str
    ksm: bool
    tcg_tb_mib: int
    log_dir: Path | None

    async def accel(self) -> tuple[str, int | None]: ...

    def readonly_private_ram(self) -> bool: ...

    def private_ram_preload(self) -> Path | None: ...

    def new_jail(self, name: str) -> Jail | None: ...

    def config_digest(self, spec: VmSpec) -> str: ...


class QemuVm(VmBase):
    """One QEMU process running one guest. Create through `QemuDriver`."""

    _VMM = "QEMU"
    _log = log
    _driver: QemuHost

    def __init__(self, driver: QemuHost, spec: VmSpec, timeouts: BootTimeouts) -> None:
        super().__init__(driver, spec, timeouts)
        self._qmp: QMPClient | None = None
        self._host_port: int | None = None
        self.accel: str | None = None
        self.qmp_ready_s: float | None = None  # spawn -> QMP negotiated
        self.restore_stats: dict[str, float] = {}
        self._config_sha256: str | None = None  # adopted VMs: from their facts
        self._jail: Jail | None = None
        self._balloon_target = 0  # MiB, as last set (a restored VM: its snapshot's own)
        self._preload: Path | None = None  # private_ram.c, for RAM mapped from a shared base

    # -- properties -----------------------------------------------------------------

    @property
    def files(self) -> QemuRunFiles:
        return QemuRunFiles.in_dir(self.work_dir, self._driver.log_dir)

    @property
    def serial_log(self) -> Path:
        return self.files.serial_log

    @property
    def stderr_log(self) -> Path:
        return self.work_dir / "qemu.stderr"

    @property
    def envd_address(self) -> tuple[str, int]:
        net = self._spec.network
        if isinstance(net, UserNet):
            if self._host_port is None:
                raise VmmStateError(f"{self._spec.name}: no forwarded port yet")
            return net.host_addr, self._host_port
        if isinstance(net, TapNet):
            return net.guest_ip, 49983
        raise VmmStateError(f"{self._spec.name}: VM has no network")

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        return procs.tail(self.stderr_log, lines) if self._work_dir else ""

    @property
    def _control_socket(self) -> Path:
        return self.files.qmp_socket

    def _log_files(self, work_dir: Path) -> tuple[Path, ...]:
        serial = QemuRunFiles.in_dir(work_dir, self._driver.log_dir).serial_log
        return serial, serial.with_name(serial.name + ".1"), work_dir / "qemu.stderr"

    def _envd_timeout_note(self) -> str:
        return f" (accel {self.accel})"

    # -- start ------------------------------------------------------------------------

    async def _start(self, *, state_file: Path | None, resume: bool = True,
                     memory: tuple[BaseImage, MemSnapshot | None] | None = None) -> None:
        if self._state is not VmState.CREATED:
            raise VmmStateError(f"{self._spec.name}: already started")
        if self._spec.kernel is not None and not self._spec.kernel.is_file():
            raise VmmStartError(f"{self._spec.name}: kernel not found: {self._spec.kernel}")
        if state_file is not None and not state_file.is_file():
            raise VmmStartError(f"{self._spec.name}: saved state not found: {state_file}")
        self._state = VmState.STARTING
        self._driver._track(self)
        try:
            self.accel, tsc_khz = await self._driver.accel()
            self._make_work_dir()
            await self._launch(tsc_khz, incoming=state_file is not None or memory is not None)
            if memory is not None:
                assert self._qmp is not None and self._proc is not None
                self.restore_stats = await qemu_memory.restore(
                    self._spec.name, self.config_sha256, self._qmp, self._proc.pid, *memory,
                    resume=resume)
                self._state = VmState.RUNNING if resume else VmState.PAUSED
            elif state_file is None:
                self._state = VmState.RUNNING
            else:
                await self._load_state(state_file, resume=resume)
        except BaseException:
            await self._kill_failed_start()
            raise

    async def _launch(self, tsc_khz: int | None, *, incoming: bool) -> None:
        """Spawn QEMU and connect QMP, retrying with a new port if the picked one was
        taken between our pick and QEMU's bind."""
        net = self._spec.network
        assert self.accel is not None
        if self._driver.log_dir is not None:
            # a crashed VM of this name may have left its logs: another uid's files, written
            # by a VMM a guest may have taken over (never chown or follow what it left)
            shutil.rmtree(self.serial_log.parent, ignore_errors=True)
            self.serial_log.parent.mkdir(parents=True, mode=0o700)
        readonly_ram = await self._private_ram()
        self._jail = self._driver.new_jail(self._spec.name)
        if self._jail is not None:
            self._jail.prepare(
                work_dir=self.work_dir, binds=await asyncio.to_thread(
                    jail_binds, self._spec, preload=self._preload,
                    log_dir=self.serial_log.parent if self._driver.log_dir is not None
                    else None),
                vcpus=self._spec.vcpus, mem_mib=self._spec.mem_mib,
                netns=net.netns if isinstance(net, TapNet) else None,
                tap=net.tap if isinstance(net, TapNet) else None, kvm=self.accel == "kvm",
                die_with_parent=self._driver.die_with_parent)
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            if isinstance(net, UserNet):
                self._host_port = net.host_port or procs.free_port(net.host_addr)
            self.argv = build_argv(self._spec, files=self.files, accel=self.accel,
                                   tsc_khz=tsc_khz, host_port=self._host_port,
                                   incoming=incoming, qemu=self._qemu_path(),
                                   tcg_tb_mib=self._driver.tcg_tb_mib,
                                   merge=self._driver.ksm, jailed=self._jail is not None,
                                   tap_fd=self._jail.tap_fd if self._jail else None,
                                   readonly_private_ram=readonly_ram)
            procs.no_huge_pages_for_children()
            if self._driver.ksm:
                procs.merge_memory_of_children()
            await self._spawn()
            try:
                await self._connect_qmp()
                return
            except _PortTaken:
                await self._reap()
                if isinstance(net, UserNet) and net.host_port:
                    raise VmmStartError(f"{self._spec.name}: host port {net.host_port} is in use",
                                        **self._tails()) from None
                log.info("%s: port %s taken, retrying (%d)", self._spec.name, self._host_port,
                         attempt)
        raise VmmStartError(f"{self._spec.name}: no free host port after {_PORT_ATTEMPTS} tries")

    async def _private_ram(self) -> bool:
        """Sets `_preload` for RAM mapped privately from a shared base with a balloon;
        whether QEMU is to open that file `readonly=on` itself (without the preload)."""
        mem = self._spec.memory
        private = mem is not None and not mem.shared
        # asked of the binary only where it matters: a private mapping of a shared file
        readonly_ram = private and self._driver.readonly_private_ram()
        self._preload = None  # set again on each launch (a restart may be another kind)
        if not (private and self._spec.balloon):
            return readonly_ram
        self._preload = await asyncio.to_thread(self._driver.private_ram_preload)
        if self._preload is not None:
            return False  # the preload opens it read-only: discards can work
        if not readonly_ram:
            raise VmmStartError(
                f"{self._spec.name}: this QEMU would punch the balloon's discards into "
                "the shared base memory file: install a C compiler (gcc) for the "
                "private-RAM preload or QEMU 8.2+ (`make setup`)")
        return True

    async def _spawn(self) -> None:
        for stale in (self.files.qmp_socket,):
            stale.unlink(missing_ok=True)
        err = await asyncio.to_thread(open, self.stderr_log, "wb")
        with err:
            mem = self._spec.memory
            env = (preload_env(self._preload, mem.path)
                   if self._preload is not None and mem is not None else None)
            if self._jail is None:
                await self._exec(stdout=asyncio.subprocess.DEVNULL, stderr=err, env=env)
            else:
                await self._exec(stdout=asyncio.subprocess.DEVNULL, stderr=err, env=env,
                                 preexec_fn=self._jail.preexec(),
                                 pass_fds=self._jail.pass_fds)
                self._jail.spawned()
        # recorded at once: a service killed during the QMP wait leaves a findable VM
        assert self._proc is not None
        (self.work_dir / "pid").write_text(str(self._proc.pid))

    def _qemu_path(self) -> str:
        """An absolute path when jailed: the binary is looked up before the jail's root
        replaces the host's (it is the same path inside, under the read-only /usr)."""
        if self._jail is None:
            return self._driver.qemu
        found = shutil.which(self._driver.qemu)
        if found is None:
            raise VmmStartError(f"{self._spec.name}: {self._driver.qemu} not found")
        return os.path.realpath(found)

    async def _release_host(self) -> None:
        if self._jail is not None:
            await asyncio.to_thread(self._jail.release)
            self._jail = None

    async def _connect_qmp(self) -> None:
        assert self._proc is not None and self.started_at is not None
        loop = asyncio.get_running_loop()
        deadline = self.started_at + self.timeouts.vmm_ready_s
        sock = self.files.qmp_socket
        while True:
            if self._proc.returncode is not None:
                if "host forwarding rule" in self.stderr_tail().lower():
                    raise _PortTaken
                raise VmmStartError(f"{self._spec.name}: QEMU exited with code "
                                    f"{self._proc.returncode} during startup", **self._tails())
            conn = await self._try_connect(sock) if sock.exists() else None
            if conn is not None:
                # no name: qemu.qmp makes a named client a logger of its own
                # (qemu.qmp.protocol.<name>), which logging keeps for the process's life:
                # one per VM ever started
                client = QMPClient()
                try:
                    await asyncio.wait_for(client.connect(conn),
                                           max(0.1, deadline - loop.time()))
                except (QMPError, OSError, TimeoutError, EOFError):
                    with contextlib.suppress(Exception):
                        await client.disconnect()
                    conn.close()
                else:
                    self._qmp = client
                    self.qmp_ready_s = loop.time() - self.started_at
                    return
            if loop.time() > deadline:
                raise VmmTimeout(f"{self._spec.name}: QMP did not answer within "
                                 f"{self.timeouts.vmm_ready_s}s", **self._tails())
            await asyncio.sleep(0.005)

    @staticmethod
    async def _try_connect(path: Path) -> socket.socket | None:
        """Connect the unix socket ourselves: QEMU binds before it listens, and letting
        the QMP library retry would log every refused attempt as an error."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, str(path))
        except OSError:
            sock.close()
            return None
        return sock

    async def _reap(self) -> None:
        if self._proc is not None:
            await procs.terminate(self._proc, grace_s=1.0)
            self._proc = None

    # -- QMP --------------------------------------------------------------------------

    async def qmp(self, cmd: str, args: dict[str, Any] | None = None, *,
                  timeout_s: float = _QMP_CALL_S) -> Any:
        """Run one QMP command; errors become VmmError (VmmStartError if QEMU died)."""
        if self._qmp is None or self._state is VmState.KILLED:
            raise VmmStateError(f"{self._spec.name}: no QMP connection (state "
                                f"{self._state.value})")
        try:
            return await asyncio.wait_for(self._qmp.execute(cmd, args), timeout_s)
        except ExecuteError as exc:
            raise VmmError(f"{self._spec.name}: QMP {cmd} failed: {exc}") from exc
        except TimeoutError as exc:
            raise VmmTimeout(f"{self._spec.name}: QMP {cmd} took over {timeout_s}s",
                             **self._tails()) from exc
        except (QMPError, OSError, EOFError) as exc:
            rc = await self._died()
            if rc is not None:
                raise VmmStartError(f"{self._spec.name}: QEMU exited with code {rc} "
                                    f"(during QMP {cmd})", **self._tails()) from exc
            raise VmmError(f"{self._spec.name}: QMP {cmd}: {exc!r}") from exc

    async def query_status(self) -> str:
        res = await self.qmp("query-status")
        return str(res["status"])

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def config_sha256(self) -> str:
        """What memory snapshots of this VM are keyed on (`QemuDriver.config_digest`)."""
        if self._config_sha256 is None:
            self._config_sha256 = self._driver.config_digest(self._spec)
        return self._config_sha256

    @property
    def start_timings(self) -> dict[str, float]:
        t = {"vmm_ready_s": self.qmp_ready_s or 0.0}
        if "restore_ms" in self.restore_stats:
            t["restore_s"] = self.restore_stats["restore_ms"] / 1e3
        return t

    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and \
            procscan.pid_alive(self._proc.pid)

    # -- balloon (balloon.py) -------------------------------------------------------------

    async def set_balloon(self, amount_mib: int) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await qemu_balloon.set_size(self.qmp, self._spec.name, self._spec.mem_mib, amount_mib)
        self._balloon_target = amount_mib

    async def balloon_stats(self) -> BalloonStats:
        self._require(VmState.RUNNING, VmState.PAUSED)
        return await qemu_balloon.stats(self.qmp, self._spec.mem_mib, self._balloon_target)

    # -- memory snapshots (memsnap) -------------------------------------------------------

    async def private_memory_mib(self) -> int | None:
        pid = self.pid
        if pid is None:
            return None
        return await asyncio.to_thread(qemu_memory.private_mib, pid, self._spec.memory)

    async def freeze_memory(self, dest: Path) -> BaseImage:
        self._require(VmState.RUNNING, VmState.PAUSED)
        assert self._qmp is not None
        self._state = VmState.PAUSED  # freezing stops the vCPUs first, even if it fails
        return await qemu_memory.freeze(self._spec.name, self._spec.memory, self._qmp,
                                        dest)

    async def snapshot_memory(
        self, dest: Path, *, base: BaseImage, parent: MemSnapshot | None,
        resume: bool = True, max_chain: int = 8,
        while_stopped: Callable[[], Awaitable[None]] | None = None,
    ) -> MemSnapshot:
        self._require(VmState.RUNNING, VmState.PAUSED)
        assert self._qmp is not None and self._proc is not None
        try:
            snap = await qemu_memory.capture(
                self._spec.name, self.config_sha256, self._qmp, self._proc.pid, dest,
                base=base, parent=parent, resume=resume, max_chain=max_chain,
                while_stopped=while_stopped)
        except BaseException:
            # the vCPUs may be stopped: make a later resume() send `cont`
            self._state = VmState.PAUSED
            raise
        if not resume:
            self._state = VmState.PAUSED
        return snap

    async def pause(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        if self._state is VmState.RUNNING:
            await self.qmp("stop")
            self._state = VmState.PAUSED

    async def resume(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        if self._state is VmState.PAUSED:
            await self.qmp("cont")
            self._state = VmState.RUNNING

    async def save_state(self, dest: Path, *, timeout_s: float = MIGRATE_S) -> None:
        """Full snapshot into `dest` (VM left PAUSED). With a shared memory file only
        device state is written; copy the memory file while the VM stays paused."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self.pause()
        await qemu_migration.save(self._spec.name, self._qmp, self.qmp, Path(dest),
                                  ram_in_file=self._spec.memory is not None,
                                  timeout_s=timeout_s)

    async def _load_state(self, state_file: Path, *, resume: bool) -> None:
        status = await qemu_migration.load(self._spec.name, self._qmp, self.qmp, state_file,
                                           ram_in_file=self._spec.memory is not None)
        info = await self.qmp("query-migrate")
        if info.get("status") not in (None, "completed"):
            raise VmmError(f"{self._spec.name}: restore failed: {info}", **self._tails())
        if status == "running":
            self._state = VmState.RUNNING
        elif status in ("paused", "postmigrate"):
            self._state = VmState.PAUSED
            if resume:
                await self.resume()
        else:
            raise VmmError(f"{self._spec.name}: unexpected status after restore: {status}",
                           **self._tails())

    # -- teardown / detach / adopt ---------------------------------------------------------

    async def _ask_quit(self, proc: procs.ProcessHandle) -> bool:
        # QMP quit: QEMU flushes its block layer and closes NBD client connections cleanly
        # (the NBD servers are dependents owned by storage/).
        asked = False
        if proc.returncode is None and self._qmp is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._qmp.execute("quit"), 1.0)
                asked = True
        return asked

    def _remove_files(self) -> None:
        super()._remove_files()
        if self._driver.log_dir is not None and self._work_dir is not None and \
                not self._spec.keep_work_dir:
            shutil.rmtree(self.serial_log.parent, ignore_errors=True)

    async def _close_control(self) -> None:
        # After the process on kill: its reader sees EOF instead of a live QEMU losing its
        # monitor mid-command.
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
        self._qmp = None

    def _facts_extra(self) -> dict[str, Any]:
        return {"host_port": self._host_port, "accel": self.accel,
                "config_sha256": self.config_sha256,
                "jail": self._jail.facts() if self._jail is not None else None}

    def _adopt_extra(self, facts: dict[str, Any]) -> None:
        self._host_port = facts.get("host_port")
        self.accel = facts.get("accel")
        self._config_sha256 = facts.get("config_sha256") or None
        jail_facts = facts.get("jail")
        if jail_facts:
            jail = self._driver.new_jail(self._spec.name)
            if jail is None:  # adopted by a service with the jail off: still cleaned up
                jail = Jail(JailConfig(), UidPool(int(jail_facts["uid"]), 1),
                            name=self._spec.name)
            jail.adopt(jail_facts, Path(facts["work_dir"]))
            self._jail = jail

    async def _connect(self) -> None:
        await self._connect_qmp()

    async def _live_state(self) -> VmState:
        status = await self.query_status()
        return VmState.PAUSED if status in ("paused", "postmigrate") else VmState.RUNNING
