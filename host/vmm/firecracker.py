"""The Firecracker driver: one `FirecrackerVm` per `firecracker` process, controlled over
its REST API on a unix socket.

A `FirecrackerVm` owns the process (its own session), the API socket, the serial log (the
process's stdout: Firecracker writes the guest's ttyS0 there), its stderr and log file
(--log-path, so its messages stay out of the serial log) and the work dir; `kill()` leaves
none of them behind.

Boot: PUT /machine-config, /boot-source, /drives/{id}, /network-interfaces/{id},
optionally /balloon, then PUT /actions InstanceStart. Pause/resume: PATCH /vm.
`save_state(dest)` writes two files, the device state to `dest` and guest memory to
`snapshot_mem_path(dest)` (PUT /snapshot/create, Full or Diff). `restore()` loads both
into a fresh process (PUT /snapshot/load with a File memory backend).

What Firecracker cannot do, and the driver rejects with a VmmError saying so:
user-mode networking (TAP only), NBD disks (it opens only files and block devices),
qcow2 images, booting without a kernel, and guest RAM in a shared host file.

NOT VERIFIED AGAINST A REAL FIRECRACKER: the development host has no Firecracker binary
and only a paravirtual (PVM) KVM, which Firecracker cannot use. The tests run this driver
against a fake API server that validates each request against a hand-written schema of
Firecracker's published OpenAPI document (tests/vmm/firecracker_api_schema.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from . import proc as procs
from .accel import _kvm_openable, _pvm_loaded
from .driver import ENVD_PORT, BootTimeouts, FileDisk, NbdDisk, TapNet, UserNet, VmSpec, VmState
from .errors import VmmError, VmmStartError, VmmStateError, VmmTimeout
from .qemu import default_run_dir
from .vmbase import TAIL_LINES, DriverBase, VmBase

log = logging.getLogger(__name__)

DEFAULT_FIRECRACKER = "firecracker"
_API_CALL_S = 10.0
_SNAPSHOT_S = 120.0
_IFACE_ID = "eth0"
_DRIVE_ID = re.compile(r"^[A-Za-z0-9_]+$")  # Firecracker accepts only these in ids


def firecracker_usable(binary: str = DEFAULT_FIRECRACKER) -> tuple[bool, str]:
    """(usable, why): the binary is on PATH and /dev/kvm opens and is not kvm-pvm
    (Firecracker needs a KVM that runs standard guests)."""
    if shutil.which(binary) is None:
        return False, f"{binary} not found on PATH"
    if not _kvm_openable():
        return False, "/dev/kvm missing or not accessible"
    if _pvm_loaded():
        return False, "KVM is kvm-pvm (paravirtual guests only); Firecracker cannot use it"
    return True, "firecracker binary and KVM present"


def snapshot_mem_path(state: Path) -> Path:
    """Where `save_state(state)` writes guest memory (Firecracker keeps it in its own file)."""
    return state.with_name(state.name + ".mem")


@dataclass(frozen=True, kw_only=True)
class BalloonConfig:
    """A virtio-balloon device (PUT /balloon before start). Stats need a polling interval."""

    amount_mib: int = 0
    deflate_on_oom: bool = True
    stats_polling_interval_s: int = 1
    free_page_reporting: bool = False


@dataclass(frozen=True)
class _Files:
    work_dir: Path

    @property
    def api_socket(self) -> Path:
        return self.work_dir / "firecracker.sock"

    @property
    def serial_log(self) -> Path:
        return self.work_dir / "serial.log"

    @property
    def stderr_log(self) -> Path:
        return self.work_dir / "firecracker.stderr"

    @property
    def vmm_log(self) -> Path:
        """Firecracker's own log (--log-path); without it, it logs into the serial stream."""
        return self.work_dir / "firecracker.log"


class FirecrackerDriver(DriverBase["FirecrackerVm"]):
    """Starts Firecracker microVMs (KVM only; see `firecracker_usable`)."""

    name = "firecracker"

    def __init__(
        self,
        *,
        firecracker: str = DEFAULT_FIRECRACKER,
        run_dir: Path | None = None,
        die_with_parent: bool = True,
        balloon: BalloonConfig | None = None,
        track_dirty_pages: bool = False,
    ) -> None:
        super().__init__(run_dir=run_dir or default_run_dir(), die_with_parent=die_with_parent)
        self.firecracker = firecracker
        self.balloon = balloon
        # Needed for Diff snapshots that hold only the pages written since the last one.
        self.track_dirty_pages = track_dirty_pages

    def _new_vm(self, spec: VmSpec, timeouts: BootTimeouts | None) -> FirecrackerVm:
        return FirecrackerVm(self, spec, timeouts or BootTimeouts())

    async def restore(
        self, spec: VmSpec, state: Path, *, timeouts: BootTimeouts | None = None,
        resume: bool = True,
    ) -> FirecrackerVm:
        """Guest memory comes from `spec.memory.path` (must be shared=False: Firecracker
        maps it copy-on-write) or else from `snapshot_mem_path(state)`."""
        vm = self._new_vm(spec, timeouts)
        await vm._start(state_file=Path(state), resume=resume)
        return vm


def check_spec(spec: VmSpec, *, restoring: bool) -> None:
    """Raise VmmError for what Firecracker cannot run."""
    if isinstance(spec.network, UserNet):
        raise VmmError(f"{spec.name}: Firecracker supports only TAP networking; user-mode "
                       "networking (UserNet/slirp) is a QEMU feature. Use TapNet.")
    for disk in spec.disks:
        if isinstance(disk, NbdDisk):
            raise VmmError(f"{spec.name}: Firecracker opens only files and block devices, not "
                           f"NBD sockets ({disk.socket}); an NBD-backed stack needs a kernel "
                           "block device (nbd-client /dev/nbdX or ublk) given as a FileDisk")
        if disk.format != "raw":
            raise VmmError(f"{spec.name}: Firecracker reads raw images only, not "
                           f"{disk.format} ({disk.path})")
        if disk.serial is not None and not _DRIVE_ID.match(disk.serial):
            raise VmmError(f"{spec.name}: drive serial {disk.serial!r} must be alphanumeric "
                           "or '_' (Firecracker uses it as the drive id)")
    if not restoring:
        if spec.kernel is None:
            raise VmmError(f"{spec.name}: Firecracker needs a kernel (vmlinux) to boot")
        if spec.memory is not None:
            raise VmmError(f"{spec.name}: Firecracker keeps fresh guest RAM anonymous; a "
                           "memory file is only used when restoring a snapshot")
    elif spec.memory is not None and spec.memory.shared:
        raise VmmError(f"{spec.name}: Firecracker maps snapshot memory copy-on-write; "
                       "restore with MemoryBacking(shared=False)")


def boot_args(base: str) -> str:
    """The kernel command line: `base` plus what Firecracker guests need, unless set.

    - console=ttyS0: the serial log is our only view of a failing boot.
    - reboot=k panic=1: Firecracker exits when the guest reboots, so a panicking guest
      (e.g. no init) ends the process within a second instead of at the boot deadline.
    - pci=off: the guest has no PCI bus unless Firecracker runs with --enable-pci;
      probing for one only slows the boot.
    """
    keys = {tok.split("=", 1)[0] for tok in shlex.split(base)}
    extra = [arg for arg in ("console=ttyS0", "reboot=k", "panic=1", "pci=off")
             if arg.split("=", 1)[0] not in keys]
    return " ".join([*extra, base.strip()]).strip()


def drive_ids(spec: VmSpec) -> list[str]:
    """The drive id of each disk: its serial (which the guest reads back as the virtio-blk
    id), else `rootfs` for the first and `diskN` for the others."""
    ids = []
    for i, disk in enumerate(spec.disks):
        ids.append(disk.serial or ("rootfs" if i == 0 else f"disk{i}"))
    if len(set(ids)) != len(ids):
        raise VmmError(f"{spec.name}: duplicate drive ids {ids}")
    return ids


class FirecrackerVm(VmBase):
    """One Firecracker process running one guest. Create through `FirecrackerDriver`."""

    _VMM = "Firecracker"
    _log = log
    _driver: FirecrackerDriver

    def __init__(self, driver: FirecrackerDriver, spec: VmSpec, timeouts: BootTimeouts
                 ) -> None:
        super().__init__(driver, spec, timeouts)
        self._api: httpx.AsyncClient | None = None
        self.api_ready_s: float | None = None

    # -- properties -----------------------------------------------------------------

    @property
    def files(self) -> _Files:
        return _Files(self.work_dir)

    @property
    def api_socket(self) -> Path:
        return self.files.api_socket

    @property
    def serial_log(self) -> Path:
        return self.files.serial_log

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
        parts = (procs.tail(self.files.stderr_log, lines), procs.tail(self.files.vmm_log, lines))
        return "\n".join(p for p in parts if p)

    @property
    def _control_socket(self) -> Path:
        return self.api_socket

    def _log_files(self, work_dir: Path) -> tuple[Path, ...]:
        files = _Files(work_dir)
        return files.serial_log, files.stderr_log, files.vmm_log

    # -- API ----------------------------------------------------------------------------

    async def api(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                  timeout_s: float = _API_CALL_S) -> Any:
        """One API request; a `fault_message` answer becomes VmmError carrying it."""
        if self._api is None or self._state is VmState.KILLED:
            raise VmmStateError(f"{self._spec.name}: no API connection (state "
                                f"{self._state.value})")
        try:
            resp = await self._api.request(method, path, json=body, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise VmmTimeout(f"{self._spec.name}: {method} {path} took over {timeout_s}s",
                             **self._tails()) from exc
        except httpx.HTTPError as exc:
            rc = await self._died()
            if rc is not None:
                raise VmmStartError(f"{self._spec.name}: Firecracker exited with code {rc} "
                                    f"(during {method} {path})", **self._tails()) from exc
            raise VmmError(f"{self._spec.name}: {method} {path}: {exc!r}") from exc
        if resp.status_code >= 300:
            try:
                fault = resp.json().get("fault_message", resp.text)
            except ValueError:
                fault = resp.text
            raise VmmError(f"{self._spec.name}: {method} {path} failed "
                           f"({resp.status_code}): {fault}")
        return resp.json() if resp.content else None

    async def instance_state(self) -> str:
        """Firecracker's own view: "Not started", "Running" or "Paused" (GET /)."""
        info = await self.api("GET", "/")
        return str(info["state"])

    # -- start ------------------------------------------------------------------------

    async def _start(self, *, state_file: Path | None, resume: bool = True) -> None:
        if self._state is not VmState.CREATED:
            raise VmmStateError(f"{self._spec.name}: already started")
        spec = self._spec
        check_spec(spec, restoring=state_file is not None)
        if spec.kernel is not None and not spec.kernel.is_file():
            raise VmmStartError(f"{spec.name}: kernel not found: {spec.kernel}")
        mem_file = None
        if state_file is not None:
            mem_file = spec.memory.path if spec.memory else snapshot_mem_path(state_file)
            for f in (state_file, mem_file):
                if not f.is_file():
                    raise VmmStartError(f"{spec.name}: snapshot file not found: {f}")
        self._state = VmState.STARTING
        self._driver._vms.append(self)
        try:
            self._make_work_dir()
            await self._spawn()
            await self._connect_api()
            if state_file is None:
                await self._configure_and_start()
            else:
                assert mem_file is not None
                await self._load_snapshot(state_file, mem_file, resume=resume)
        except BaseException:
            await self._kill_failed_start()
            raise

    async def _spawn(self) -> None:
        files = self.files
        files.api_socket.unlink(missing_ok=True)  # Firecracker refuses an existing path
        self.argv = [self._driver.firecracker, "--api-sock", str(files.api_socket),
                     "--log-path", str(files.vmm_log)]
        net = self._spec.network
        if isinstance(net, TapNet) and net.netns:
            self.argv = ["ip", "netns", "exec", net.netns, *self.argv]
        out = await asyncio.to_thread(open, files.serial_log, "wb")
        err = await asyncio.to_thread(open, files.stderr_log, "wb")
        with out, err:
            await self._exec(stdout=out, stderr=err)

    async def _connect_api(self) -> None:
        """Poll GET / until the API answers, the process exits or vmm_ready_s passes."""
        assert self._proc is not None and self.started_at is not None
        loop = asyncio.get_running_loop()
        deadline = self.started_at + self.timeouts.vmm_ready_s
        sock = self.api_socket
        client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock)),
                                   base_url="http://localhost", trust_env=False,
                                   timeout=httpx.Timeout(_API_CALL_S, connect=0.5))
        try:
            while True:
                if self._proc.returncode is not None:
                    raise VmmStartError(f"{self._spec.name}: Firecracker exited with code "
                                        f"{self._proc.returncode} during startup",
                                        **self._tails())
                if sock.exists():
                    with contextlib.suppress(httpx.TransportError):
                        resp = await client.get("/")
                        if resp.status_code == 200:
                            self._api = client
                            self.api_ready_s = loop.time() - self.started_at
                            return
                if loop.time() > deadline:
                    raise VmmTimeout(f"{self._spec.name}: Firecracker API did not answer "
                                     f"within {self.timeouts.vmm_ready_s}s", **self._tails())
                await asyncio.sleep(0.005)
        finally:
            if self._api is not client:
                await client.aclose()

    async def _configure_and_start(self) -> None:
        spec, drv = self._spec, self._driver
        assert spec.kernel is not None
        await self.api("PUT", "/machine-config", {
            "vcpu_count": spec.vcpus, "mem_size_mib": spec.mem_mib,
            "track_dirty_pages": drv.track_dirty_pages})
        boot: dict[str, Any] = {"kernel_image_path": str(spec.kernel),
                                "boot_args": boot_args(spec.cmdline)}
        if spec.initrd is not None:
            boot["initrd_path"] = str(spec.initrd)
        await self.api("PUT", "/boot-source", boot)
        # is_root_device makes Firecracker append root=/dev/vda; skip it when the cmdline
        # already names a root, so the two cannot disagree.
        cmdline_root = any(t.startswith("root=") for t in spec.cmdline.split())
        for i, (drive_id, disk) in enumerate(zip(drive_ids(spec), spec.disks, strict=True)):
            assert isinstance(disk, FileDisk)
            await self.api("PUT", f"/drives/{drive_id}", {
                "drive_id": drive_id, "path_on_host": str(disk.path),
                "is_root_device": i == 0 and not cmdline_root,
                "is_read_only": disk.read_only})
        if isinstance(spec.network, TapNet):
            await self.api("PUT", f"/network-interfaces/{_IFACE_ID}", {
                "iface_id": _IFACE_ID, "host_dev_name": spec.network.tap,
                "guest_mac": spec.network.mac})
        if drv.balloon is not None:
            b = drv.balloon
            await self.api("PUT", "/balloon", {
                "amount_mib": b.amount_mib, "deflate_on_oom": b.deflate_on_oom,
                "stats_polling_interval_s": b.stats_polling_interval_s,
                "free_page_reporting": b.free_page_reporting})
        await self.api("PUT", "/actions", {"action_type": "InstanceStart"})
        self._state = VmState.RUNNING

    async def _load_snapshot(self, state_file: Path, mem_file: Path, *, resume: bool) -> None:
        spec = self._spec
        body: dict[str, Any] = {
            "snapshot_path": str(state_file),
            "mem_backend": {"backend_type": "File", "backend_path": str(mem_file)},
            "track_dirty_pages": self._driver.track_dirty_pages,
            # Disk paths are re-pointed below while paused, before the guest runs.
            "resume_vm": resume and not spec.disks,
        }
        if isinstance(spec.network, TapNet):
            # The snapshot names the TAP of the saved VM; each restored VM has its own.
            body["network_overrides"] = [{"iface_id": _IFACE_ID,
                                          "host_dev_name": spec.network.tap}]
        await self.api("PUT", "/snapshot/load", body, timeout_s=_SNAPSHOT_S)
        self._state = VmState.RUNNING if body["resume_vm"] else VmState.PAUSED
        # Firecracker reopens the saved drive paths on load (they must still exist);
        # PATCH swaps in this VM's own copies.
        for drive_id, disk in zip(drive_ids(spec), spec.disks, strict=True):
            assert isinstance(disk, FileDisk)
            await self.api("PATCH", f"/drives/{drive_id}",
                           {"drive_id": drive_id, "path_on_host": str(disk.path)})
        if resume:
            await self.resume()

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

    async def save_state(self, dest: Path, *, diff: bool = False) -> None:
        """Snapshot into `dest` (device state) and `snapshot_mem_path(dest)` (memory); the
        VM is left PAUSED. diff=True writes only pages dirtied since the last snapshot
        (with track_dirty_pages): merge it onto its base before restoring."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        dest = Path(dest)
        await self.pause()
        await self.api("PUT", "/snapshot/create", {
            "snapshot_type": "Diff" if diff else "Full", "snapshot_path": str(dest),
            "mem_file_path": str(snapshot_mem_path(dest))}, timeout_s=_SNAPSHOT_S)

    # -- balloon --------------------------------------------------------------------------

    async def balloon_stats(self) -> dict[str, Any]:
        """GET /balloon/statistics (needs a BalloonConfig with a polling interval)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        return dict(await self.api("GET", "/balloon/statistics"))

    async def set_balloon(self, amount_mib: int) -> None:
        """Inflate/deflate the balloon to `amount_mib` (PATCH /balloon)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        await self.api("PATCH", "/balloon", {"amount_mib": amount_mib})

    # -- teardown / detach / adopt ---------------------------------------------------------
    # Firecracker has no graceful-quit API call (SendCtrlAltDel only asks the guest to
    # reboot), and it exits on SIGTERM: kill() only signals it.

    async def _close_control(self) -> None:
        if self._api is not None:
            with contextlib.suppress(Exception):
                await self._api.aclose()
        self._api = None

    async def _connect(self) -> None:
        await self._connect_api()

    async def _live_state(self) -> VmState:
        return VmState.PAUSED if await self.instance_state() == "Paused" else VmState.RUNNING
