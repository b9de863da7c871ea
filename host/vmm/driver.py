"""The VMM driver interface shared by the QEMU and Firecracker drivers.

A driver turns a frozen `VmSpec` into a running `Vm`. The `Vm` object owns everything the
VM needs on the host (process, API/QMP socket, serial log, work dir) and removes all of it
in `kill()`/`aclose()`. Drivers never see HTTP objects or the state store; they raise only
`VmmError` subclasses (see `errors.py`).

Typical use::

    driver = QemuDriver()
    async with await driver.start(spec) as vm:      # boots; kills on any error
        await vm.wait_for_envd(timeout_s=120)
        url = vm.envd_url                           # http://127.0.0.1:<port>
        await vm.pause(); await vm.resume()
        await vm.save_state(path)                   # VM is paused afterwards
    # leaving the block killed the VM and removed its work dir
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    from .identity import VmmIdentity
    from .memsnap import BaseImage, MemSnapshot

ENVD_PORT = 49983
"""envd's port inside the guest."""


# ---------------------------------------------------------------------------------------
# Spec values


@dataclass(frozen=True, kw_only=True)
class FileDisk:
    """A disk backed by a host file (raw or qcow2). Attached in order: first is /dev/vda."""

    path: Path
    read_only: bool = False
    format: str = "raw"
    # Optional virtio-blk serial (visible in the guest at /sys/block/vdX/serial), lets an
    # init find a layer by name instead of by probe order.
    serial: str | None = None
    # the file a qcow2 overlay reads through (QEMU opens it too: a jail exposes it)
    backing: Path | None = None


@dataclass(frozen=True, kw_only=True)
class NbdDisk:
    """A disk served over NBD on a unix socket (the storage layer's userspace server)."""

    socket: Path
    export: str
    read_only: bool = False
    serial: str | None = None


Disk = FileDisk | NbdDisk


@dataclass(frozen=True, kw_only=True)
class UserNet:
    """User-mode networking (slirp) with one host TCP port forwarded to guest envd.

    `host_port=None` lets the driver pick a free port (retrying if another process takes
    it between the pick and QEMU's bind). Guest side: 10.0.2.15/24, gateway 10.0.2.2.

    `restrict` (the default) gives the guest no outbound network at all, only the
    forwarded port: slirp maps the gateway 10.0.2.2 to the host's loopback, so an
    unrestricted guest reaches every service listening there (the API, the proxy, other
    sandboxes' forwarded ports), and slirp has no per-destination filter to stop that.
    """

    host_port: int | None = None
    restrict: bool = True
    host_addr: str = "127.0.0.1"
    guest_port: int = ENVD_PORT
    mac: str = "52:54:00:12:34:56"


@dataclass(frozen=True, kw_only=True)
class TapNet:
    """A TAP device (optionally inside a network namespace) set up by host/network.

    The VMM process is started inside `netns` (via `ip netns exec`) so the TAP is
    reachable; envd is then reached at `guest_ip:ENVD_PORT` from inside that namespace or
    through whatever forwarding host/network installs.
    """

    tap: str
    guest_ip: str
    netns: str | None = None
    mac: str = "52:54:00:12:34:56"


Network = UserNet | TapNet


@dataclass(frozen=True, kw_only=True)
class MemoryBacking:
    """Guest RAM as a host file (memory snapshots).

    shared=True: writes go to the file (MAP_SHARED); a full snapshot then needs only device
    state (x-ignore-shared). shared=False: the file is mapped copy-on-write (MAP_PRIVATE),
    e.g. children of a frozen base memory file. The file must not change while VMs map it
    privately.
    """

    path: Path
    shared: bool = True


@dataclass(frozen=True, kw_only=True)
class VmSpec:
    """Everything needed to start one VM. Identical specs give identical VMM command
    lines, which snapshots require (same devices, ids, kernel path)."""

    # None boots no guest kernel (firmware only): enough to exercise the VMM plumbing
    # (QMP, pause, snapshots, teardown) in tests. Firecracker drivers may reject it.
    kernel: Path | None
    cmdline: str = ""
    vcpus: int = 1
    mem_mib: int = 512
    initrd: Path | None = None
    disks: tuple[Disk, ...] = ()
    network: Network | None = field(default_factory=UserNet)
    memory: MemoryBacking | None = None
    # A virtio-balloon with free-page reporting: the guest hands pages it freed back to
    # the host (within seconds), and the host may inflate it to take more (overcommit).
    balloon: bool = True
    # Where sockets, serial log and VMM logs live. None: the driver makes a fresh temp dir
    # (and removes it on kill). An explicit dir is created if missing; files the driver
    # created in it are removed on kill unless keep_work_dir.
    work_dir: Path | None = None
    keep_work_dir: bool = False
    name: str = "vm"
    # Under TCG, at least this much translated code is kept before QEMU flushes it all
    # (None: the driver's cap, sized for many sandboxes). Not part of what a snapshot
    # restores into. A template build's VM asks for more: its cold boot translates over
    # 64 MiB, and a flush mid-boot costs it 5 % (host/runtime/builds.py).
    tcg_tb_mib: int | None = None

    def __post_init__(self) -> None:
        if self.vcpus < 1:
            raise ValueError(f"vcpus must be >= 1, got {self.vcpus}")
        if self.mem_mib < 16:
            raise ValueError(f"mem_mib must be >= 16, got {self.mem_mib}")


# A guest with a balloon reports free blocks of 2^7 pages (512 KiB), not of its pageblock
# order (2^10 here): the kernel reports only while a zone holds 32 free blocks of the order
# above its low watermark (PAGE_REPORTING_CAPACITY), 128 MiB at order 10, which a small
# guest seldom has (measured: a 256 MiB guest that freed 90 MiB reported nothing), and
# free memory in smaller blocks is never reported. Measured (TCG, one 512 MiB guest that
# allocated and freed 300 MiB, its QEMU's PSS less TCG's code after / idle): order 9
# 1.39x, order 7 1.26x. Order 7 needs 16 MiB free; a report is still a few calls per 16 MiB.
REPORTING_ORDER = "page_reporting.page_reporting_order"
# How long freed blocks wait to be reported: our kernel's parameter (kernel/patches; 2 s
# fixed upstream). Each run reports a sixteenth of a free list and the next waits this
# long again, so a guest that dropped 200 MiB of page cache took ~30 s to give it all back;
# a snapshot right after it copied the lot. At 20 ms it is back in a few hundred ms
# (host/runtime/snapshots.py waits for it), and what is freed and soon reused in steady
# state costs the host a page fault more per page.
REPORTING_DELAY = "page_reporting.page_reporting_delay_ms"
REPORTING_DELAY_MS = 20
# Free pages the guest keeps on its per-CPU lists are invisible to reporting: since Linux
# 6.7 those lists grow on their own up to an eighth of the zone while a process frees a lot,
# and stay there. Measured (TCG, 512 MiB guest, /proc/zoneinfo `count:` after a process
# allocated, touched and freed 300 MiB): 9784 pages (38 MiB) on the list, the host holding
# 61 MiB of the guest against 22 before. A fixed fraction stops the growth: 1/512 of the
# zone (the kernel's floor, 4 batches, in a small guest), what a 1-2 vCPU guest needs.
PCP_HIGH_FRACTION = "sysctl.vm.percpu_pagelist_high_fraction"
PCP_HIGH_FRACTION_VALUE = 512


def balloon_cmdline(spec: VmSpec) -> str:
    """`spec.cmdline` with what its balloon needs in the guest (each unless already set)."""
    if not spec.balloon:
        return spec.cmdline
    extra = [f"{key}={value}" for key, value in ((REPORTING_ORDER, 7),
                                                 (REPORTING_DELAY, REPORTING_DELAY_MS),
                                                 (PCP_HIGH_FRACTION, PCP_HIGH_FRACTION_VALUE))
             if f"{key}=" not in spec.cmdline]
    return " ".join([spec.cmdline, *extra]).strip()


@dataclass(frozen=True, kw_only=True)
class BalloonStats:
    """A VM's balloon: how much of its RAM it holds now (`size_mib`, returned to the host)
    and the guest's own view, when it has reported one (None before the first report)."""

    size_mib: int
    target_mib: int
    available_mib: int | None = None  # the guest's MemAvailable (free + reclaimable cache)
    free_mib: int | None = None
    caches_mib: int | None = None


@dataclass(frozen=True, kw_only=True)
class BootTimeouts:
    """Per-phase deadlines for `VmmDriver.start` and `Vm.wait_for_envd` (seconds)."""

    vmm_ready_s: float = 15.0  # process started -> QMP/API socket answers
    envd_ready_s: float = 180.0  # VM started -> envd /health answers (TCG cold boots are slow)
    kill_s: float = 5.0  # graceful quit before SIGKILL


class VmState(enum.Enum):
    """Lifecycle of one `Vm` handle."""

    CREATED = "created"  # object exists, nothing started
    STARTING = "starting"  # VMM process launched, not yet running the guest
    RUNNING = "running"
    PAUSED = "paused"  # vCPUs stopped (pause, or after save_state / an incoming restore)
    KILLED = "killed"  # process gone, files removed; terminal
    DETACHED = "detached"  # handle released, VM left running (adopt it again); terminal


# ---------------------------------------------------------------------------------------
# Interfaces


@runtime_checkable
class Vm(Protocol):
    """A handle on one VM. Async context manager: `__aexit__` calls `aclose()`."""

    @property
    def spec(self) -> VmSpec: ...

    @property
    def state(self) -> VmState: ...

    @property
    def pid(self) -> int | None:
        """The VMM process id while it runs, else None."""

    @property
    def work_dir(self) -> Path: ...

    @property
    def serial_log(self) -> Path:
        """File receiving the guest serial console (ttyS0)."""

    def serial_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the guest serial console ('' before start)."""

    @property
    def envd_address(self) -> tuple[str, int]:
        """(host, port) at which envd is reachable from this host."""

    @property
    def envd_url(self) -> str:
        """`http://host:port` for envd (what E2B_SANDBOX_URL should be)."""

    async def wait_for_envd(self, timeout_s: float | None = None) -> float:
        """Wait until envd answers GET /health; returns seconds waited.

        Raises VmmBootTimeout (with serial/stderr tails) on timeout and VmmStartError if
        the VMM process exits meanwhile. Does not kill the VM: the caller decides.
        """

    async def pause(self) -> None:
        """Stop the vCPUs. Idempotent when already paused."""

    async def resume(self) -> None:
        """Continue the vCPUs. Idempotent when already running."""

    async def save_state(self, dest: Path) -> None:
        """Write a snapshot of CPU/device state (and RAM unless it lives in a shared
        memory file) to `dest`. The VM is left PAUSED; `resume()` to continue."""

    @property
    def start_timings(self) -> dict[str, float]:
        """Stages of this VM's start in seconds: `vmm_ready_s` (spawn -> control socket
        answers) and, for restores, `restore_s` (memory + device state loaded)."""

    def alive(self) -> bool:
        """Whether the VMM process still runs (False once it exited by itself or was
        killed). Cheap: no control-channel round trip."""

    # -- memory snapshots (what the node runtime uses) -----------------------------------
    # A memory snapshot is in memsnap's on-disk form whatever the driver: a frozen base
    # (`BaseImage`: base.mem + the driver's device-state/template file + base.json) and
    # diffs on it (`MemSnapshot`: diff chain + device state + snapshot.json), so the
    # runtime's manifests, repository uploads and caches do not depend on the VMM.

    async def freeze_memory(self, dest: Path) -> BaseImage:
        """Freeze this VM's RAM and device state into a new base in `dest` (created).
        Needs RAM in a shared file (`MemoryBacking(shared=True)`). The VM is left PAUSED
        (resume it, or kill it and restore children from the base)."""

    async def snapshot_memory(
        self, dest: Path, *, base: BaseImage, parent: MemSnapshot | None,
        resume: bool = True, max_chain: int = 8,
        while_stopped: Callable[[], Awaitable[None]] | None = None,
    ) -> MemSnapshot:
        """Capture what changed in RAM since `base` (this VM maps it copy-on-write, as
        started by `restore_memory`) plus device state, into `dest`. `parent`: the
        snapshot this VM was restored from (chain continues on it). `while_stopped` runs
        while the vCPUs are stopped (cut the disk at the same instant). `resume=False`
        leaves the VM PAUSED. `stats` carries downtime_ms, diff_pages, chain_len."""

    async def set_balloon(self, amount_mib: int) -> None:
        """Inflate (or deflate, down to 0) the balloon to `amount_mib`: the guest gives that
        much of its RAM back to the host (a spec with `balloon`). Asynchronous: the guest
        gets there at its pace (`balloon_stats().size_mib`); with deflate-on-oom it takes
        pages back rather than OOM-kill."""

    async def balloon_stats(self) -> BalloonStats:
        """The balloon's size and target, and the guest's last memory report."""

    async def private_memory_mib(self) -> int | None:
        """MiB of guest RAM that differs from the VM's memory file (copied on write: what
        a memory diff copies, and what a guest's free-page reports give back); None where
        the VMM cannot tell, or for RAM that is not a private mapping of a file."""

    async def kill(self) -> None:
        """Stop the VMM and remove everything it owned. Idempotent; never raises for an
        already-dead process. Post-condition: the process is reaped, sockets are gone,
        and the work dir is removed unless the spec asked to keep it."""

    async def aclose(self) -> None:
        """Same as kill()."""

    def facts(self) -> dict[str, Any]:
        """JSON-serializable facts (pid, sockets, work dir, port, ...) from which
        `VmmDriver.adopt()` re-attaches to this VM after a host-service restart."""

    async def detach(self) -> None:
        """Release this handle (control connection) but leave the VM running, e.g. on a
        host-service shutdown; the state becomes DETACHED. Adopt it again later."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc_info: object) -> None: ...


@runtime_checkable
class VmmDriver(Protocol):
    """Creates VMs. A driver instance remembers the VMs it created (`vms`)."""

    name: str

    @property
    def vms(self) -> Sequence[Vm]:
        """VMs started by this driver that have not been killed."""

    async def start(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> Vm:
        """Launch the VMM and start the guest; returns once the VMM's control socket
        answers (it does NOT wait for envd: call `vm.wait_for_envd()`). On any failure
        nothing is left behind and a VmmError is raised."""

    async def boot(self, spec: VmSpec, *, timeouts: BootTimeouts | None = None) -> Vm:
        """start() then wait_for_envd(); the VM is killed if envd does not come up."""

    async def restore(
        self, spec: VmSpec, state: Path, *, timeouts: BootTimeouts | None = None,
        resume: bool = True,
    ) -> Vm:
        """Start a VM from a `save_state` file. `spec` must describe the same machine as
        the saved VM (devices, kernel, memory size); disk paths may differ (give each
        restored VM its own copy of the writable disk as it was at save time). A VM saved
        with a shared memory file restores with that file as `shared=True` (it continues
        in the file) or `shared=False` (copy-on-write: many VMs from one file). With
        resume=False the VM stays PAUSED."""

    def config_digest(self, spec: VmSpec) -> str:
        """Hex digest of everything about `spec` a memory snapshot depends on (VMM
        version, machine, devices, kernel and command line), with per-instance parts
        (paths, sockets, ports, namespace) left out: a snapshot restores only into a VM
        with the same digest."""

    def identity(self) -> VmmIdentity:
        """What this driver's memory snapshots depend on besides the spec: VMM version,
        accelerator, guest CPU model (identity.py). Recorded with each snapshot; the
        runtime refuses a restore under another. Blocking the first time (runs the VMM
        with --version; cached)."""

    async def restore_memory(
        self, spec: VmSpec, *, base: BaseImage, snapshot: MemSnapshot | None = None,
        timeouts: BootTimeouts | None = None, resume: bool = True,
    ) -> Vm:
        """Start a VM from a frozen base (and the diff chain of `snapshot` on it); guest
        RAM maps `base.mem_path` copy-on-write, so many VMs share one base. `spec.memory`
        must be `MemoryBacking(path=base.mem_path, shared=False)`. Nothing is left behind
        on failure."""

    def leftovers(self, run_dir: Path) -> dict[int, str]:
        """{pid: name of its work dir} of this driver's VMM processes whose work dir lies
        directly under `run_dir`, found from /proc (VMs whose handle was lost: a service
        killed between spawn and recording the VM)."""

    async def kill_pid(self, pid: int, work_dir: Path) -> None:
        """Kill a leftover VMM process (one `leftovers` found, or the pid recorded in
        `work_dir/pid`) if it is this driver's process for `work_dir`; then `discard`
        `work_dir`."""

    async def discard(self, work_dir: Path) -> None:
        """Remove what a VM whose process is gone left on the host: its jail (cgroup,
        devices), `work_dir` and its logs elsewhere. Idempotent."""

    def leftover_names(self, run_dir: Path) -> set[str]:
        """Names of the VMs of which something is left under `run_dir` (a work dir) or
        with this driver (logs), whatever their processes: `discard`'s candidates."""

    async def adopt(self, spec: VmSpec, facts: dict[str, Any], *,
                    timeouts: BootTimeouts | None = None) -> Vm | None:
        """Re-attach to a VM started earlier (possibly by another process) from its
        `facts()`; None when that VM is gone (its leftover files are then removed).
        VMs meant to outlive the host service must be started by a driver that does not
        tie them to its own lifetime (QemuDriver(die_with_parent=False))."""

    async def aclose(self) -> None:
        """Kill every VM still alive."""
