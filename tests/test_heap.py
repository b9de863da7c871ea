"""host/heap.py: with the mmap threshold fixed and the arenas capped, big buffers that
threads allocate and free go back to the system; glibc's defaults keep them (the RSS
ratchet bench/bench_gc.py measured). Each case runs in a process of its own: the
settings are made once, before any thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import sys, threading
    from host import heap
    if sys.argv[1] == "on":
        assert heap.configure()

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) >> 10

    base = rss_mib()
    survivors = []

    def work():
        for _ in range(20):  # s3transfer-sized parts, touched, then freed
            parts = [bytearray(8 << 20) for _ in range(4)]
            for p in parts:
                p[::4096] = b"x" * len(p[::4096])
            survivors.append(bytearray(200))  # small allocations between them
            del parts

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(base, rss_mib())
""")


def _grown_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    base, after = int(out[0]), int(out[1])
    return after - base


def test_freed_big_buffers_go_back_to_the_system() -> None:
    kept_by_default, kept_configured = _grown_mib("off"), _grown_mib("on")
    print(f"\nRSS kept after 480 freed 8 MiB buffers in 6 threads: {kept_by_default} MiB "
          f"with glibc's defaults, {kept_configured} MiB configured")
    assert kept_configured <= 4
    assert kept_by_default > kept_configured  # what the settings are for
