"""What a VMM jail is allowed (`JailConfig`) and the sandbox uids it hands out (`UidPool`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VmmError

# A block of ids no distribution, container runtime (subuid ranges start at 100000 and
# grow by 65536) or directory service hands out by default.
DEFAULT_UID_RANGE = "1879048192-1879113727"  # 0x70000000, 65536 ids


class UidRangeError(VmmError, ValueError):
    """A `--vm-uid-range` that is not `FIRST-LAST` of unprivileged ids."""


def parse_uid_range(text: str) -> tuple[int, int]:
    """"FIRST-LAST" -> (first, count); ids must be > 0 and below 2^32 - 1."""
    try:
        first_s, last_s = text.split("-", 1)
        first, last = int(first_s), int(last_s)
    except ValueError:
        raise UidRangeError(f"--vm-uid-range {text!r}: expected FIRST-LAST, e.g. "
                            f"{DEFAULT_UID_RANGE}") from None
    if not 0 < first <= last < 2**32 - 1:
        raise UidRangeError(f"--vm-uid-range {text!r}: ids must satisfy 0 < FIRST <= LAST "
                            "< 4294967295 (uid 0 is root; -1 means 'unchanged' to the kernel)")
    return first, last - first + 1


@dataclass(frozen=True, kw_only=True)
class JailConfig:
    """How every VMM process is confined (host/config.py sets it from `--vm-jail`,
    `--vm-uid-range` and `--vm-overhead-mib`).

    - `uid_range`: each VM runs as its own uid and gid from this block.
    - `overhead_mib`: the VMM's own memory on top of guest RAM in its cgroup's memory
      limit (QEMU's heap, device buffers, under TCG its 64 MiB code buffer; measured
      70-110 MiB resident for a busy 512 MiB guest), with room to spare.
    - `pids`: threads of the VMM process (QEMU: a thread per vCPU, the main loop, RCU and
      up to 64 pooled I/O workers).
    - `io_weight`: the VM's share of disk bandwidth against other VMs (v2 `io.weight`).
    - `fsize_bytes`: the largest file the VMM may write (RLIMIT_FSIZE): the serial
      console log is bounded by it even between rotations; device-state files are far
      smaller.
    - `root`: the empty directory each jail mounts its private root on, inside its own
      mount namespace (the host never sees anything mounted there).
    """

    enabled: bool = True
    uid_range: tuple[int, int] = field(default_factory=lambda: parse_uid_range(DEFAULT_UID_RANGE))
    overhead_mib: int = 256
    pids: int = 256
    io_weight: int = 100
    fsize_bytes: int = 16 << 20
    cgroup_parent: str = "aenv-vms"
    root: Path = Path("/run/aenv/jail-root")


class UidPool:
    """Hands out one uid of the range per live VM (its gid is the same number). Ids of
    VMs adopted after a restart are claimed back from their facts. Thread-safe: drivers
    allocate from the event loop, cleanup may run in worker threads."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self._used: set[int] = set()
        self._next = 0
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            for i in range(self.count):
                uid = self.first + (self._next + i) % self.count
                if uid not in self._used:
                    self._used.add(uid)
                    # round-robin: a freed id is not reused at once, so a lingering file
                    # of the last VM that had it is not handed to the next one at once
                    self._next = (uid - self.first + 1) % self.count
                    return uid
        raise VmmError(f"all {self.count} VM uids of the jail's range are in use")

    def claim(self, uid: int) -> None:
        if not self.first <= uid < self.first + self.count:
            raise VmmError(f"uid {uid} is outside the jail's range")
        with self._lock:
            self._used.add(uid)

    def release(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)

    def in_use(self) -> set[int]:
        with self._lock:
            return set(self._used)
