"""`FirecrackerVm`: one Firecracker process running one guest (see firecracker.py).

It owns the process (its own session; through `jailer` when configured), the API
connection, the serial log (the process's stdout: Firecracker writes the guest's ttyS0
there), its stderr and log file, the /dev/nbdN its NbdDisks are attached as, the chroot
if jailed, and the work dir; `kill()` leaves none of them behind. Snapshots are in
snapshots.py (`MemoryMixin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import proc as procs
from .. import procscan
from ..driver import ENVD_PORT, BalloonStats, BootTimeouts, FileDisk, TapNet, VmSpec, VmState
from ..errors import VmmError, VmmStartError, VmmStateError
from ..vmbase import TAIL_LINES, VmBase
from .api import API_CALL_S, FirecrackerApi
from .config import FirecrackerHost, boot_requests, check_spec, drive_ids, drive_path, load_request
from .jailer import API_SOCKET, HostRoot, JailRoot, jail_record, release_jail
from .leftovers import DEVICES_FILE, record_devices
from .snapshots import MemoryMixin, snapshot_mem_path

if TYPE_CHECKING:
    from ..memsnap import BaseImage, MemSnapshot

log = logging.getLogger(__package__)

SNAPSHOT_S = 120.0


class FirecrackerVm(MemoryMixin, VmBase):
    """One Firecracker process running one guest. Create through `FirecrackerDriver`."""

    _VMM = "Firecracker"
    _log = log
    _driver: FirecrackerHost

    def __init__(self, driver: FirecrackerHost, spec: VmSpec, timeouts: BootTimeouts
                 ) -> None:
        super().__init__(driver, spec, timeouts)
        self._api: FirecrackerApi | None = None
        self.api_ready_s: float | None = None
        self._root: HostRoot | None = None
        self._devices: list[Path] = []  # attached /dev/nbdN, in spec.disks order
        self._jail: dict[str, Any] | None = None  # an adopted VM's jail record
        self._uid: int | None = None  # the uid the jailer runs this VM as, from the pool
        self._restore_s: float | None = None

    # -- properties -----------------------------------------------------------------

    @property
    def root(self) -> HostRoot:
        """What the process sees as its files (work dir, or the jailer's chroot)."""
        if self._root is None:
            raise VmmStateError(f"{self._spec.name}: not started")
        return self._root

    @property
    def api_socket(self) -> Path:
        return self.work_dir / API_SOCKET

    @property
    def serial_log(self) -> Path:
        return self.work_dir / "serial.log"

    @property
    def stderr_log(self) -> Path:
        return self.work_dir / "firecracker.stderr"

    @property
    def vmm_log(self) -> Path:
        """Firecracker's own log (--log-path); without it, it logs into the serial stream."""
        return self._root.vmm_log if self._root else self.work_dir / "firecracker.log"

    @property
    def devices(self) -> list[Path]:
        """The kernel block devices this VM's NbdDisks are attached as."""
        return list(self._devices)

    @property
    def envd_address(self) -> tuple[str, int]:
        net = self._spec.network
        if isinstance(net, TapNet):
            return net.guest_ip, ENVD_PORT
        raise VmmStateError(f"{self._spec.name}: VM has no network")

    def stderr_tail(self, lines: int = TAIL_LINES) -> str:
        """The tails of Firecracker's stderr and of its log file."""
        if self._work_dir is None:
            return ""
        parts = (procs.tail(self.stderr_log, lines), procs.tail(self.vmm_log, lines))
        return "\n".join(p for p in parts if p)

    @property
    def _control_socket(self) -> Path:
        return self.api_socket

    def _log_files(self, work_dir: Path) -> tuple[Path, ...]:
        return (work_dir / "serial.log", work_dir / "firecracker.stderr",
                work_dir / "firecracker.log", work_dir / "pid", work_dir / DEVICES_FILE)

    @property
    def start_timings(self) -> dict[str, float]:
        """`vmm_ready_s` (spawn -> API answers); for restores `restore_s` (memory file
        prepared + PUT /snapshot/load, the spawn in between not counted)."""
        out = {}
        if self.api_ready_s is not None:
            out["vmm_ready_s"] = self.api_ready_s
        if self._restore_s is not None:
            out["restore_s"] = self._restore_s
        return out

    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and \
            procscan.pid_alive(self._proc.pid)

    # -- API ----------------------------------------------------------------------------

    async def api(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                  timeout_s: float = API_CALL_S) -> Any:
        """One API request; a `fault_message` answer becomes VmmError carrying it."""
        if self._api is None or not self._api.connected or self._state is VmState.KILLED:
            raise VmmStateError(f"{self._spec.name}: no API connection (state "
                                f"{self._state.value})")
        return await self._api.request(method, path, body, timeout_s=timeout_s)

    async def instance_state(self) -> str:
        """Firecracker's own view: "Not started", "Running" or "Paused" (GET /)."""
        info = await self.api("GET", "/")
        return str(info["state"])

    # -- start ------------------------------------------------------------------------

    async def _start(self, *, state_file: Path | None, resume: bool = True,
                     memory: tuple[BaseImage, MemSnapshot | None] | None = None) -> None:
        if self._state is not VmState.CREATED:
            raise VmmStateError(f"{self._spec.name}: already started")
        spec = self._spec
        check_spec(spec, restoring=state_file is not None or memory is not None)
        if spec.kernel is not None and not spec.kernel.is_file():
            raise VmmStartError(f"{spec.name}: kernel not found: {spec.kernel}")
        mem_file = None
        if state_file is not None:
            mem_file = spec.memory.path if spec.memory else snapshot_mem_path(state_file)
            for f in (state_file, mem_file):
                if not f.is_file():
                    raise VmmStartError(f"{spec.name}: snapshot file not found: {f}")
        if memory is not None:
            await self._verify_restore(*memory)
        self._state = VmState.STARTING
        self._driver._track(self)
        try:
            self._make_work_dir()
            jail = self._driver.jailer_for_vm()
            self._uid = jail.uid if jail is not None else None
            self._root = (JailRoot(self.work_dir, jail, self._driver.firecracker) if jail
                          else HostRoot(self.work_dir))
            await self._root.prepare()
            await self._expose_disks()
            t_restore = time.perf_counter()
            if memory is not None:
                state_rel, mem_rel = await self._prepare_memory(*memory)
            elif state_file is not None:
                assert mem_file is not None
                state_rel = await self._root.expose(state_file, "state/vmstate")
                mem_rel = await self._root.expose(mem_file, "mem/guest.mem")
            prepare_s = time.perf_counter() - t_restore
            await self._spawn()
            await self._connect_api()
            if state_file is None and memory is None:
                await self._configure_and_start()
            else:
                body = load_request(spec, state=state_rel, mem=mem_rel, resume=resume,
                                    track_dirty_pages=self._driver.track_dirty_pages)
                t_load = time.perf_counter()
                await self.api("PUT", "/snapshot/load", body, timeout_s=SNAPSHOT_S)
                self._restore_s = prepare_s + time.perf_counter() - t_load
                self._tracking = self._driver.track_dirty_pages
                self._state = VmState.RUNNING if resume else VmState.PAUSED
            with contextlib.suppress(VmmError):  # for facts(): computed off the loop now
                await self._config_digest()
        except BaseException:
            await self._kill_failed_start()
            raise

    async def _expose_disks(self) -> None:
        """Each disk at `drives/<id>` for the process; NbdDisks attached as /dev/nbdN
        first (recorded at once, so kill_pid can detach them after a crash)."""
        for drive_id, disk in zip(drive_ids(self._spec), self._spec.disks, strict=True):
            if isinstance(disk, FileDisk):
                src = disk.path
            else:
                src = await self._driver.block.attach(disk)
                self._devices.append(src)
                record_devices(self.work_dir, self._devices)
            if not src.exists():
                raise VmmStartError(f"{self._spec.name}: disk not found: {src}")
            await self.root.expose(src, drive_path(drive_id))

    async def _spawn(self) -> None:
        net = self._spec.network
        netns = net.netns if isinstance(net, TapNet) else None
        self.argv = self.root.argv(self._driver.firecracker, netns)
        # append: the node's log rotation (proc.rotate_log) truncates it under the writer
        out = await asyncio.to_thread(open, self.serial_log, "ab")
        err = await asyncio.to_thread(open, self.stderr_log, "wb")
        with out, err:
            await self._exec(stdout=out, stderr=err, cwd=self.root.root)
        # recorded at once: a service killed during the API wait leaves a findable VM
        assert self._proc is not None
        (self.work_dir / "pid").write_text(str(self._proc.pid))

    async def _connect_api(self) -> None:
        """Poll GET / until the API answers, the process exits or vmm_ready_s passes."""
        proc = self._proc
        assert proc is not None and self.started_at is not None
        api = FirecrackerApi(self.api_socket, name=self._spec.name,
                             exited=lambda: proc.returncode, died=self._died,
                             tails=self._tails)
        await api.connect(deadline=self.started_at + self.timeouts.vmm_ready_s,
                          timeout_s=self.timeouts.vmm_ready_s)
        self._api = api
        self.api_ready_s = asyncio.get_running_loop().time() - self.started_at

    async def _configure_and_start(self) -> None:
        spec, drv = self._spec, self._driver
        assert spec.kernel is not None
        kernel = await self.root.expose(spec.kernel, "boot/vmlinux")
        initrd = (await self.root.expose(spec.initrd, "boot/initrd")
                  if spec.initrd is not None else None)
        for method, path, body in boot_requests(spec, kernel=kernel, initrd=initrd,
                                                track_dirty_pages=drv.track_dirty_pages,
                                                balloon=drv.balloon):
            await self.api(method, path, body)
        self._tracking = drv.track_dirty_pages
        self._state = VmState.RUNNING

    # -- lifecycle ----------------------------------------------------------------------

    async def pause(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        if self._state is VmState.RUNNING:
            await self.api("PATCH", "/vm", {"state": "Paused"})
            self._state = VmState.PAUSED

    async def resume(self) -> None:
        self._require(VmState.RUNNING, VmState.PAUSED)
        if self._state is VmState.PAUSED:
            await self.api("PATCH", "/vm", {"state": "Resumed"})
            self._state = VmState.RUNNING

    # -- balloon --------------------------------------------------------------------------

    async def balloon_stats(self) -> BalloonStats:
        """GET /balloon/statistics (the balloon's config sets a polling interval)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        raw = dict(await self.api("GET", "/balloon/statistics"))

        def mib(key: str) -> int | None:
            return int(raw[key]) >> 20 if key in raw else None

        return BalloonStats(size_mib=int(raw.get("actual_mib", 0)),
                            target_mib=int(raw.get("target_mib", 0)),
                            available_mib=mib("available_memory"), free_mib=mib("free_memory"),
                            caches_mib=mib("disk_caches"))

    async def set_balloon(self, amount_mib: int) -> None:
        """Inflate/deflate the balloon to `amount_mib` (PATCH /balloon)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self.api("PATCH", "/balloon", {"amount_mib": amount_mib})

    # -- teardown / detach / adopt ---------------------------------------------------------
    # Firecracker has no graceful-quit API call (SendCtrlAltDel only asks the guest to
    # reboot), and it exits on SIGTERM: kill() only signals it.

    async def _close_control(self) -> None:
        if self._api is not None:
            await self._api.aclose()
        self._api = None

    async def _release_host(self) -> None:
        # The process is gone: nothing holds the chroot's mounts or the NBD devices.
        if self._work_dir is not None:
            try:
                await release_jail(self._work_dir, jail_record(self._work_dir) or self._jail)
            except VmmError as exc:
                log.error("%s: %s", self._spec.name, exc)
        for dev in reversed(self._devices):
            try:
                await self._driver.block.detach(dev)
            except VmmError as exc:
                log.error("%s: %s", self._spec.name, exc)
        self._devices = []
        if self._uid is not None:
            self._driver.release_uid(self._uid)
            self._uid = None

    def _remove_files(self) -> None:
        if self._root is not None and not self._spec.keep_work_dir:
            self._root.remove()
        super()._remove_files()

    def _facts_extra(self) -> dict[str, Any]:
        return {"devices": [str(d) for d in self._devices],
                "jail": jail_record(self.work_dir), **self._memory_facts()}

    def _adopt_extra(self, facts: dict[str, Any]) -> None:
        self._devices = [Path(d) for d in facts.get("devices", [])]
        self._jail = facts.get("jail")
        jail = self._driver.jailer
        if jail is not None and self._jail and "uid" in self._jail:
            # the VM runs as the uid it was given: claim it back
            uid, gid = int(self._jail["uid"]), int(self._jail["gid"])
            jail = dataclasses.replace(jail, uid=uid, gid=gid)
            if self._driver.uids is not None and uid != 0:
                self._driver.uids.claim(uid)
                self._uid = uid
        self._root = (JailRoot(self.work_dir, jail, self._driver.firecracker)
                      if jail is not None and self._jail else HostRoot(self.work_dir))
        self._adopt_memory(facts)

    async def _adopt(self, facts: dict[str, Any]) -> bool:
        started = facts.get("pid_start")
        if started is None or procs.start_time(int(facts["pid"])) != started:
            # Gone: free its devices and unmount its jail before its files are removed.
            self._work_dir = Path(facts["work_dir"])
            self._adopt_extra(facts)
            await self._release_host()
        return await super()._adopt(facts)

    async def _connect(self) -> None:
        await self._connect_api()

    async def _live_state(self) -> VmState:
        return VmState.PAUSED if await self.instance_state() == "Paused" else VmState.RUNNING
