"""What the QEMU and Firecracker drivers share (see driver.py for the interface).

`DriverBase` keeps a driver's list of live VMs; `VmBase` is the VM handle's plumbing that
does not depend on how the VMM is controlled: the process spawned in its own session, the
work dir and who owns it, kill with a deadline and a check that the process group is gone,
the log tails, and facts()/detach()/adopt(). A driver fills in the hooks (control socket,
log files, graceful quit, closing its control connection, the live state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Generic, Protocol, Self, TypeVar

from . import proc as procs
from .driver import BootTimeouts, VmSpec, VmState
from .errors import VmmBootTimeout, VmmError, VmmStartError, VmmStateError
from .readiness import wait_for_health

TAIL_LINES = 30

VmT = TypeVar("VmT", bound="VmBase")


def default_run_dir() -> Path:
    """Parent of per-VM work dirs: $AENV_RUN_DIR, else /run/aenv/vms (root), else /tmp.
    Kept short: unix socket paths are limited to 107 bytes."""
    env = os.environ.get("AENV_RUN_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0 and Path("/run").is_dir():
        return Path("/run/aenv/vms")
    return Path(tempfile.gettempdir()) / "aenv-vms"


class DriverBase(Generic[VmT]):
    """The VMs a driver started or adopted and has not killed or detached yet."""

    name: str

    def __init__(self, *, run_dir: Path, die_with_parent: bool) -> None:
        self.run_dir = run_dir
        self.die_with_parent = die_with_parent
        self._vms: list[VmT] = []

    @property
    def vms(self) -> list[VmT]:
        return list(self._vms)

    def _new_vm(self, spec: VmSpec, timeouts: BootTimeouts | None) -> VmT:
        raise NotImplementedError

    async def start(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> VmT:
        vm = self._new_vm(spec, timeouts)
        await vm._start(state_file=None)
        return vm

    async def boot(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> VmT:
        """start() + wait_for_envd(); the VM is killed if envd does not come up."""
        vm = await self.start(spec, timeouts=timeouts)
        try:
            await vm.wait_for_envd()
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def adopt(self, spec: VmSpec, facts: dict[str, Any], *,
                    timeouts: BootTimeouts | None = None) -> VmT | None:
        vm = self._new_vm(spec, timeouts)
        return vm if await vm._adopt(facts) else None

    def leftovers(self, run_dir: Path) -> dict[int, str]:
        raise NotImplementedError

    def leftover_names(self, run_dir: Path) -> set[str]:
        names = set(self.leftovers(run_dir).values())
        if run_dir.is_dir():
            names |= {d.name for d in run_dir.iterdir()}
        return names

    async def aclose(self) -> None:
        errors: list[BaseException] = []
        for vm in reversed(self.vms):
            try:
                await vm.kill()
            except VmmError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _track(self, vm: VmT) -> None:
        self._vms.append(vm)

    def _forget(self, vm: VmT) -> None:
        with contextlib.suppress(ValueError):
            self._vms.remove(vm)


class VmHost(Protocol):
    """What `VmBase` uses of the driver that made its VM (a `DriverBase`); a driver's VM
    class narrows it to its own driver, or to a protocol of what it uses."""

    name: str
    run_dir: Path
    die_with_parent: bool

    def _track(self, vm: Any) -> None: ...

    def _forget(self, vm: Any) -> None: ...


class VmBase:
    """One VMM process running one guest; the driver-independent half of a Vm."""

    _VMM = "VMM"  # the VMM's name in messages: "QEMU", "Firecracker"
    _log = logging.getLogger(__name__)
    _driver: VmHost

    def __init__(self, driver: VmHost, spec: VmSpec, timeouts: BootTimeouts) -> None:
        self._driver = driver
        self._spec = spec
        self.timeouts = timeouts
        self._state = VmState.CREATED
        self._proc: procs.ProcessHandle | None = None
        self._work_dir: Path | None = None
        self._owns_work_dir = False
        self._kill_task: asyncio.Task[None] | None = None
        self.argv: list[str] = []
        self.started_at: float | None = None  # loop time of the spawn

    # -- hooks ------------------------------------------------------------------------

    async def _start(self, *, state_file: Path | None, resume: bool = True) -> None:
        raise NotImplementedError

    @property
    def envd_address(self) -> tuple[str, int]:
        raise NotImplementedError

    @property
    def serial_log(self) -> Path:
        raise NotImplementedError

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        raise NotImplementedError

    @property
    def _control_socket(self) -> Path:
        """The unix socket the VMM is controlled over (in the work dir)."""
        raise NotImplementedError

    def _log_files(self, work_dir: Path) -> tuple[Path, ...]:
        """The files in `work_dir` removed with a work dir this VM does not own."""
        raise NotImplementedError

    def _envd_timeout_note(self) -> str:
        """Appended to the envd boot timeout message."""
        return ""

    async def _connect(self) -> None:
        """Connect the control channel (within vmm_ready_s of `started_at`)."""
        raise NotImplementedError

    async def _live_state(self) -> VmState:
        """RUNNING or PAUSED, asked of the VMM over the control channel."""
        raise NotImplementedError

    async def _ask_quit(self, proc: procs.ProcessHandle) -> bool:
        """Ask the VMM to exit before it is signalled; True if it was asked."""
        return False

    async def _close_control(self) -> None:
        """Close the control connection (errors ignored) and forget it."""
        raise NotImplementedError

    async def _release_host(self) -> None:
        """Release what the VMM held outside its work dir (kernel block devices, mounts)
        after its process is gone; errors are logged, not raised (kill must finish)."""

    def _facts_extra(self) -> dict[str, Any]:
        return {}

    def _adopt_extra(self, facts: dict[str, Any]) -> None:
        pass

    # -- properties -----------------------------------------------------------------

    @property
    def spec(self) -> VmSpec:
        return self._spec

    @property
    def state(self) -> VmState:
        return self._state

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._proc.returncode is not None:
            return None
        return self._proc.pid

    @property
    def work_dir(self) -> Path:
        if self._work_dir is None:
            raise VmmStateError(f"{self._spec.name}: not started")
        return self._work_dir

    @property
    def envd_url(self) -> str:
        host, port = self.envd_address
        return f"http://{host}:{port}"

    def serial_tail(self, lines: int = TAIL_LINES) -> str:
        return procs.tail(self.serial_log, lines) if self._work_dir else ""

    def _tails(self) -> dict[str, str]:
        return {"serial_tail": self.serial_tail(), "stderr_tail": self.stderr_tail()}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._spec.name} {self._state.value} pid={self.pid}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _require(self, *states: VmState) -> None:
        if self._state not in states:
            raise VmmStateError(f"{self._spec.name}: is {self._state.value}, needs one of "
                                f"{', '.join(s.value for s in states)}")

    # -- start ------------------------------------------------------------------------

    def _make_work_dir(self) -> None:
        spec = self._spec
        # root's only (0700, as mkdtemp makes it): it may hold guest RAM, serial logs
        if spec.work_dir is None:
            self._driver.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", spec.name)[:40]
            self._work_dir = Path(tempfile.mkdtemp(prefix=f"{safe}-", dir=self._driver.run_dir))
            self._owns_work_dir = True
        else:
            self._owns_work_dir = not spec.work_dir.exists()
            spec.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._work_dir = spec.work_dir
        if len(str(self._control_socket)) > 107:
            raise VmmStartError(f"work dir path too long for a unix socket: {self._work_dir}")

    async def _exec(self, *, stdout: int | IO[bytes], stderr: IO[bytes],
                    cwd: Path | None = None, preexec_fn: Callable[[], None] | None = None,
                    pass_fds: tuple[int, ...] = (), env: dict[str, str] | None = None) -> None:
        """Spawn `argv` in a new session (killed with us if the driver says so; a jail's
        `preexec_fn` sets that up itself, after its change of uid clears it)."""
        loop = asyncio.get_running_loop()
        if preexec_fn is None and self._driver.die_with_parent:
            preexec_fn = procs.die_with_parent
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                start_new_session=True, cwd=cwd, preexec_fn=preexec_fn, pass_fds=pass_fds,
                env=env)
        except (OSError, subprocess.SubprocessError) as exc:
            raise VmmStartError(f"{self._spec.name}: cannot run {self.argv[0]}: {exc}") \
                from exc
        self.started_at = loop.time()
        self._log.debug("%s: started pid %d: %s", self._spec.name, self._proc.pid,
                        shlex.join(self.argv))

    async def _kill_failed_start(self) -> None:
        """Never leave a process or file behind, whatever went wrong (cancel included)."""
        try:
            await self.kill()
        except VmmError as exc:
            self._log.error("cleanup after failed start of %s failed: %s", self._spec.name, exc)

    async def _died(self) -> int | None:
        """The exit code if the VMM has exited (waiting briefly for the reaper)."""
        if self._proc is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), 0.2)
        return self._proc.returncode

    # -- lifecycle ----------------------------------------------------------------------

    async def wait_for_envd(self, timeout_s: float | None = None) -> float:
        self._require(VmState.RUNNING)
        timeout_s = self.timeouts.envd_ready_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        url = self.envd_url
        proc = self._proc
        assert proc is not None
        try:
            async with asyncio.timeout(timeout_s):
                await wait_for_health(url, alive=lambda: proc.returncode is None)
        except TimeoutError:
            raise VmmBootTimeout(f"{self._spec.name}: envd did not answer {url}/health within "
                                 f"{timeout_s:g}s{self._envd_timeout_note()}",
                                 **self._tails()) from None
        if proc.returncode is not None:
            raise VmmStartError(f"{self._spec.name}: {self._VMM} exited with code "
                                f"{proc.returncode} before envd answered", **self._tails())
        return loop.time() - t0

    # -- teardown -----------------------------------------------------------------------

    async def private_memory_mib(self) -> int | None:
        """See `Vm.private_memory_mib`; None unless the driver can tell (QEMU does)."""
        return None

    async def kill(self) -> None:
        """Idempotent; shielded, so a cancelled caller cannot leave a half-killed VM.
        A no-op after detach(): the VM then belongs to whoever adopts it."""
        if self._state in (VmState.KILLED, VmState.DETACHED) and self._kill_task is None:
            return
        if self._kill_task is None:
            self._kill_task = asyncio.ensure_future(self._kill())
        await asyncio.shield(self._kill_task)

    async def aclose(self) -> None:
        await self.kill()

    async def _kill(self) -> None:
        proc = self._proc
        gone = True
        if proc is not None:
            # 1. The VMM's own way to quit, if it has one; 2. then signals, with deadlines,
            #    until the process group is really gone.
            asked = await self._ask_quit(proc)
            gone = await procs.terminate(proc, grace_s=self.timeouts.kill_s, already_asked=asked)
        # 3. Close the control connection after the process: no request races its exit.
        await self._close_control()
        # 4. Host resources the process held open (block devices, mounts), once it is gone.
        if gone:
            await self._release_host()
        # 5. Files last, once nothing writes to them.
        self._remove_files()
        self._state = VmState.KILLED
        self._driver._forget(self)
        if not gone:
            raise VmmError(f"{self._spec.name}: {self._VMM} pid {proc.pid if proc else '?'} "
                           "survived SIGKILL")

    def _remove_files(self) -> None:
        if self._work_dir is None:
            return
        self._control_socket.unlink(missing_ok=True)
        if self._spec.keep_work_dir:
            return
        if self._owns_work_dir:
            shutil.rmtree(self._work_dir, ignore_errors=True)
        else:
            for p in self._log_files(self._work_dir):
                p.unlink(missing_ok=True)

    # -- detach / adopt -------------------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        self._require(VmState.RUNNING, VmState.PAUSED)
        assert self._proc is not None and self._work_dir is not None
        return {
            "driver": self._driver.name,
            "name": self._spec.name,
            "pid": self._proc.pid,
            "pid_start": procs.start_time(self._proc.pid),
            "work_dir": str(self._work_dir),
            "owns_work_dir": self._owns_work_dir,
            **self._facts_extra(),
            "argv": list(self.argv),
        }

    async def detach(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._close_control()
        self._proc = None
        self._state = VmState.DETACHED
        self._driver._forget(self)

    async def _adopt(self, facts: dict[str, Any]) -> bool:
        """Re-attach to the VMM process described by `facts`; False (leftovers removed)
        when it is gone. A live one that does not answer is killed and VmmError raised."""
        if facts.get("driver") != self._driver.name:
            raise VmmError(f"{self._spec.name}: facts are not from the {self._VMM} driver: "
                           f"{facts}")
        self._work_dir = Path(facts["work_dir"])
        self._owns_work_dir = bool(facts.get("owns_work_dir"))
        self._adopt_extra(facts)
        self.argv = list(facts.get("argv", []))
        pid, started = int(facts["pid"]), facts.get("pid_start")
        if started is None or procs.start_time(pid) != started:
            await self._release_host()
            self._remove_files()
            self._state = VmState.KILLED
            return False
        self._proc = procs.AdoptedProcess(pid, int(started))
        self._state = VmState.STARTING
        self._driver._track(self)
        try:
            self.started_at = asyncio.get_running_loop().time()
            await self._connect()
            state = await self._live_state()
        except BaseException:
            gone = self._proc.returncode is not None
            await self.kill()
            if gone:
                return False
            raise
        self._state = state
        return True
