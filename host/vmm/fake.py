"""An in-memory VMM driver for unit tests of the layers above (no process, no root, no KVM).

`FakeDriver(envd_url=...)` hands out `FakeVm`s that follow the same state rules as real
VMs and point at an envd URL of the test's choosing (e.g. an unfrozen envd on the host).
Failures are injected per operation: `FakeDriver(fail={"start": VmmStartError("boom")})`
raises on every start; `fail_once` raises only on the next call. `calls` records every
operation as (op, vm name) in order.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

from .driver import BalloonStats, BootTimeouts, VmSpec, VmState
from .errors import VmmError, VmmStateError
from .identity import VmmIdentity
from .memsnap import BaseImage, MemSnapshot

_pids = itertools.count(900_000)


class FakeVm:
    def __init__(self, driver: FakeDriver, spec: VmSpec) -> None:
        self._driver = driver
        self._spec = spec
        self._state = VmState.CREATED
        self._pid = next(_pids)
        self.balloon_mib = 0
        # what the fake guest could give back (its MemAvailable before any balloon)
        self.guest_available_mib = spec.mem_mib // 2
        # what private_memory_mib() answers (None: unknown, as a VMM that cannot tell)
        self.private_mib: int | list[int] | None = None
        self.saved_to: list[Path] = []

    @property
    def spec(self) -> VmSpec:
        return self._spec

    @property
    def state(self) -> VmState:
        return self._state

    @property
    def pid(self) -> int | None:
        dead = (VmState.CREATED, VmState.KILLED, VmState.DETACHED)
        return None if self._state in dead else self._pid

    @property
    def work_dir(self) -> Path:
        return self._spec.work_dir or Path(f"/nonexistent/fake-vms/{self._spec.name}")

    @property
    def serial_log(self) -> Path:
        return self.work_dir / "serial.log"

    def serial_tail(self, lines: int = 30) -> str:
        return ""

    @property
    def envd_address(self) -> tuple[str, int]:
        host, _, port = self._driver.envd_url.removeprefix("http://").partition(":")
        return host, int(port or 80)

    @property
    def envd_url(self) -> str:
        return self._driver.envd_url

    def _require(self, *states: VmState) -> None:
        if self._state not in states:
            raise VmmStateError(f"{self._spec.name}: is {self._state.value}")

    async def wait_for_envd(self, timeout_s: float | None = None) -> float:
        self._require(VmState.RUNNING)
        await self._driver._op("wait_for_envd", self)
        return 0.0

    async def pause(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("pause", self)
        self._state = VmState.PAUSED

    async def resume(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("resume", self)
        self._state = VmState.RUNNING

    async def save_state(self, dest: Path) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("save_state", self)
        self._state = VmState.PAUSED
        Path(dest).write_text(f"fake-state {self._spec.name}\n")
        self.saved_to.append(Path(dest))

    @property
    def start_timings(self) -> dict[str, float]:
        return {"vmm_ready_s": 0.0}

    def alive(self) -> bool:
        return self._state in (VmState.RUNNING, VmState.PAUSED)

    async def set_balloon(self, amount_mib: int) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        if not self._spec.balloon or not 0 <= amount_mib < self._spec.mem_mib:
            raise VmmError(f"{self._spec.name}: no balloon of {amount_mib} MiB here")
        await self._driver._op("set_balloon", self)
        self.balloon_mib = amount_mib  # a fake guest gives it at once

    async def balloon_stats(self) -> BalloonStats:
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("balloon_stats", self)
        kept = self._spec.mem_mib - self.balloon_mib
        available = max(0, min(kept, self.guest_available_mib - self.balloon_mib))
        return BalloonStats(size_mib=self.balloon_mib, target_mib=self.balloon_mib,
                            available_mib=available, free_mib=available, caches_mib=0)

    async def private_memory_mib(self) -> int | None:
        """`private_mib`, settable: a test scripts what the guest gives back (a list is
        read one value per call, its last value repeated)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("private_memory_mib", self)
        if isinstance(self.private_mib, list):
            return self.private_mib.pop(0) if len(self.private_mib) > 1 else self.private_mib[0]
        return self.private_mib

    async def freeze_memory(self, dest: Path) -> BaseImage:
        """Records the call; returns a BaseImage naming `dest` (no files are written)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("freeze_memory", self)
        self._state = VmState.PAUSED
        return BaseImage(Path(dest), Path(dest) / "base.mem", Path(dest) / "base.dev",
                         bytes(32), self._spec.mem_mib << 20)

    async def snapshot_memory(
        self, dest: Path, *, base: BaseImage, parent: MemSnapshot | None,
        resume: bool = True, max_chain: int = 8,
        while_stopped: Callable[[], Awaitable[None]] | None = None,
    ) -> MemSnapshot:
        """Records the call, runs `while_stopped`; returns a MemSnapshot naming `dest`."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self._driver._op("snapshot_memory", self)
        if while_stopped is not None:
            await while_stopped()
        if not resume:
            self._state = VmState.PAUSED
        chain = (*parent.diffs, Path(dest) / "mem.diff") if parent else (Path(dest) / "mem.diff",)
        return MemSnapshot(Path(dest), base.sha256, bytes(32), chain,
                           tuple(bytes(32) for _ in chain), Path(dest) / "devstate.bin",
                           bytes(32), {"downtime_ms": 0.0, "chain_len": float(len(chain))})

    async def kill(self) -> None:
        if self._state in (VmState.KILLED, VmState.DETACHED):
            return
        self._driver.calls.append(("kill", self._spec.name))
        self._state = VmState.KILLED
        if self in self._driver._vms:
            self._driver._vms.remove(self)

    async def aclose(self) -> None:
        await self.kill()

    def facts(self) -> dict[str, Any]:
        return {"driver": "fake", "name": self._spec.name, "pid": self._pid,
                "paused": self._state is VmState.PAUSED}

    async def detach(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        self._driver.calls.append(("detach", self._spec.name))
        self._driver._detached[self._pid] = self
        self._state = VmState.DETACHED
        self._driver._vms.remove(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class FakeDriver:
    name = "fake"

    def __init__(self, *, envd_url: str = "http://127.0.0.1:49983",
                 fail: dict[str, BaseException] | None = None, delay_s: float = 0.0,
                 identity: VmmIdentity | None = None) -> None:
        self.envd_url = envd_url
        self.vmm_identity = identity or VmmIdentity(vmm="fake", version="fake 1.0",
                                                    accel="tcg", cpu="max")
        self.fail = dict(fail or {})
        self.fail_once: dict[str, BaseException] = {}
        self.delay_s = delay_s
        self.calls: list[tuple[str, str]] = []
        self._vms: list[FakeVm] = []
        self._detached: dict[int, FakeVm] = {}

    @property
    def vms(self) -> list[FakeVm]:
        return list(self._vms)

    async def _op(self, op: str, vm: FakeVm) -> None:
        self.calls.append((op, vm.spec.name))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        exc = self.fail_once.pop(op, None) or self.fail.get(op)
        if exc is not None:
            raise exc

    async def _launch(self, op: str, spec: VmSpec, state: VmState) -> FakeVm:
        vm = FakeVm(self, spec)
        await self._op(op, vm)  # failing here leaves nothing, like the real drivers
        vm._state = state
        self._vms.append(vm)
        return vm

    async def start(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> FakeVm:
        return await self._launch("start", spec, VmState.RUNNING)

    async def boot(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> FakeVm:
        vm = await self.start(spec, timeouts=timeouts)
        try:
            await vm.wait_for_envd()
        except BaseException:
            await vm.kill()
            raise
        return vm

    async def restore(self, spec: VmSpec, state: Path, *, timeouts: BootTimeouts | None = None,
                      resume: bool = True) -> FakeVm:
        if not Path(state).is_file():
            raise VmmError(f"{spec.name}: saved state not found: {state}")
        return await self._launch("restore", spec,
                                  VmState.RUNNING if resume else VmState.PAUSED)

    def config_digest(self, spec: VmSpec) -> str:
        return f"fake-{spec.vcpus}-{spec.mem_mib}-{spec.kernel}"

    def identity(self) -> VmmIdentity:
        """`identity=` of the constructor (settable: `vmm_identity`, a pretend upgrade)."""
        return self.vmm_identity

    async def restore_memory(
        self, spec: VmSpec, *, base: BaseImage, snapshot: MemSnapshot | None = None,
        timeouts: BootTimeouts | None = None, resume: bool = True,
    ) -> FakeVm:
        return await self._launch("restore_memory", spec,
                                  VmState.RUNNING if resume else VmState.PAUSED)

    def leftovers(self, run_dir: Path) -> dict[int, str]:
        return {}

    async def kill_pid(self, pid: int, work_dir: Path) -> None:
        self.calls.append(("kill_pid", str(pid)))

    async def discard(self, work_dir: Path) -> None:
        shutil.rmtree(work_dir, ignore_errors=True)

    def leftover_names(self, run_dir: Path) -> set[str]:
        return {d.name for d in run_dir.iterdir()} if run_dir.is_dir() else set()

    async def adopt(self, spec: VmSpec, facts: dict[str, Any], *,
                    timeouts: BootTimeouts | None = None) -> FakeVm | None:
        """Adopts VMs detached from this same FakeDriver (a pretend restart)."""
        old = self._detached.pop(int(facts.get("pid", -1)), None)
        self.calls.append(("adopt", spec.name))
        if old is None:
            return None
        vm = FakeVm(self, spec)
        vm._pid = old._pid
        vm._state = VmState.PAUSED if facts.get("paused") else VmState.RUNNING
        self._vms.append(vm)
        return vm

    async def aclose(self) -> None:
        for vm in self.vms:
            await vm.kill()
