"""How much memory the node has left for its VMs: the host's, or its memory cgroup's.

Both admission (refusing starts) and the pressure guard (pausing the coldest sandboxes)
decide from `node_available_mib()`. A service confined to a memory cgroup (systemd's
MemoryMax, a container's limit) is OOM-killed at the cgroup's limit however much the
host has free, so the smaller of the two counts.
"""

from __future__ import annotations

from pathlib import Path

_UNLIMITED = 1 << 60


def mem_available_mib(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no MemAvailable in {meminfo}")


# memory.stat keys (v2, v1): the cgroup's page cache, and the part of it mapped by processes
_V2_STAT = ("file", "file_mapped")
_V1_STAT = ("total_cache", "total_mapped_file")


def _cgroup_free_mib(d: Path, limit_file: str, usage_file: str,
                     stat_keys: tuple[str, str]) -> int | None:
    """What a memory cgroup directory `d` leaves: its limit - its usage + the page cache
    no process maps (None when it has no limit). Mapped cache is not counted as free: it
    is the VMs' own RAM files (a snapshot's base, shared copy-on-write), and reclaiming
    it makes every guest fault it back from disk: thrashing, not free memory."""
    try:
        raw = (d / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= _UNLIMITED:
            return None
        usage = int((d / usage_file).read_text())
        stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    cache, mapped = (int(stat.get(k, 0)) for k in stat_keys)
    return (int(raw) - usage + max(0, cache - mapped)) // (1024 * 1024)


def cgroup_available_mib(proc_cgroup: Path = Path("/proc/self/cgroup"),
                         root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The least any memory cgroup above this process leaves it (v2 `memory.max` or v1
    `memory.limit_in_bytes`, walking up to the root), None when none is limited."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: memory.max where the memory controller is on
            base, files = root, ("memory.max", "memory.current", _V2_STAT)
        elif "memory" in controllers.split(","):  # v1
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            _V1_STAT)
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            if (free := _cgroup_free_mib(d, *files)) is not None:
                found.append(free)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(found) if found else None


def node_available_mib() -> int:
    """Memory the node can still give its VMs (MiB): MemAvailable, or less when the
    service runs in a memory cgroup that leaves it less."""
    host = mem_available_mib()
    cg = cgroup_available_mib()
    return host if cg is None else min(host, cg)


KSM_DIR = Path("/sys/kernel/mm/ksm")


class KsmSwitch:
    """The host's same-page merging daemon (`--ksm`): VMs restored from one template hold
    many identical private pages (the kernel and envd dirtied the same way after every
    restore); ksmd merges them. Host-wide, so the service turns it on only when asked and
    turns it back off at exit only if it was the one to turn it on. Off by default:
    merged pages are a timing side channel between the guests that share them."""

    def __init__(self, d: Path = KSM_DIR) -> None:
        self.run = d / "run"
        self._turned_on = False

    def enable(self) -> str:
        """Start ksmd if it is stopped; what happened, for the log."""
        try:
            state = self.run.read_text().strip()
            if state == "1":
                return "KSM: ksmd was already running"
            self.run.write_text("1\n")
        except OSError as exc:
            return f"KSM unavailable ({exc}): guest pages are not merged"
        self._turned_on = True
        return f"KSM: started ksmd ({self.run} was {state})"

    def restore(self) -> None:
        if self._turned_on:
            self._turned_on = False
            try:
                self.run.write_text("0\n")
            except OSError:
                pass
