"""host/heap.py: with the mmap threshold fixed and the arenas capped, big buffers that
threads allocate and free go back to the system; glibc's defaults keep them (the RSS
ratchet bench/bench_gc.py measured). Each case runs in a process of its own: the
settings are made once, before any thread."""

from __future__ import annotations

import os
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


FRAGMENTS = textwrap.dedent("""
    import os, sys
    from host import heap
    heap.configure()

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) >> 10

    base = rss_mib()
    objs = [{"i": i} for i in range(400_000)]  # ~100 MiB of small objects
    kept = objs[::200]  # one in 200 outlives the rest (a record, a cache entry)
    del objs
    heap.trim()
    print(os.environ.get("PYTHONMALLOC", "pymalloc"), base, rss_mib(), len(kept))
""")


def _kept_by_fragments(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", FRAGMENTS], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=120, env=env).stdout.split()
    return int(out[2]) - int(out[1])


def test_small_objects_freed_around_survivors_go_back_with_c_malloc() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    pymalloc = _kept_by_fragments(env)
    c_malloc = _kept_by_fragments({**env, "PYTHONMALLOC": "malloc"})
    print(f"\nRSS kept after freeing 199 in 200 of 400k small dicts, then trim: "
          f"{pymalloc} MiB under pymalloc, {c_malloc} MiB under C malloc")
    assert c_malloc * 2 < pymalloc  # pymalloc's arenas stay while one object lives in them


def test_the_service_runs_with_c_malloc_and_keeps_an_operators_choice() -> None:
    probe = ("from host import heap; heap.use_c_malloc(); import os, sys; "
             "print(os.environ['PYTHONMALLOC'], sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    out = subprocess.run([sys.executable, "-c", probe, "a", "b"], cwd=REPO, env=env,
                         check=True, capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["malloc", "['a',", "'b']"]  # re-executed, its argv kept
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO,
                         env={**env, "PYTHONMALLOC": "pymalloc"}, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.split()[0] == "pymalloc"
