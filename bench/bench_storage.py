"""Block I/O through our block server vs qemu-storage-daemon (the C NBD peer) vs the raw file.

    .venv/bin/python bench/bench_storage.py [--size-mib 256] [--runs 3] [--json out/bench_storage.json]

All three serve the same bytes: a random image, as a raw file (direct), exported over NBD
on a unix socket by qemu-storage-daemon, and converted into a base LSMT layer under an
empty upper in our block server. `qemu-img bench` drives each one (writeback cache, queue
depth 4): sequential 1 MiB reads/writes and scattered 4 KiB reads/writes (a large prime
step that wraps around the image, since qemu-img bench has no random mode). Prints n,
median and p95 MB/s per target and the ratios ours/qsd and ours/raw; samples go to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from host.storage.control import SyncBlockServerClient
from host.storage.convert import convert_image

MiB = 1 << 20
STEP_4K = 4096 * 7919  # prime number of blocks: visits blocks in a scattered order


def workloads(size: int) -> list[tuple[str, list[str], int]]:
    """(name, qemu-img bench args, bytes moved)."""
    seq_n = 2 * size // MiB
    rnd_n = 20000
    return [
        ("seq-read-1M", ["-c", str(seq_n), "-d", "4", "-s", "1M"], seq_n * MiB),
        ("seq-write-1M", ["-w", "-c", str(seq_n // 2), "-d", "4", "-s", "1M"], seq_n // 2 * MiB),
        ("rand-read-4K", ["-c", str(rnd_n), "-d", "4", "-s", "4k", "-S", str(STEP_4K)],
         rnd_n * 4096),
        ("rand-write-4K", ["-w", "-c", str(rnd_n), "-d", "4", "-s", "4k", "-S", str(STEP_4K)],
         rnd_n * 4096),
    ]


def run_bench(target: str, args: list[str]) -> float:
    r = subprocess.run(["qemu-img", "bench", "-f", "raw", "-t", "writeback", *args, target],
                       check=False, capture_output=True, text=True, timeout=600)
    m = re.search(r"Run completed in ([0-9.]+) seconds", r.stdout)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"qemu-img bench {args} {target}: {r.stdout}{r.stderr}")
    return float(m.group(1))


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args!r} did not create {path}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=str(REPO / "out" / "bench_storage.json"))
    a = ap.parse_args()
    size = a.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="bench-storage-", dir="/var/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        img = work / "disk.raw"
        with open(img, "wb") as f:
            f.writelines(os.urandom(MiB) for _ in range(a.size_mib))
        qsd_img = work / "qsd.raw"
        shutil.copyfile(img, qsd_img)
        raw_img = work / "direct.raw"
        shutil.copyfile(img, raw_img)
        (work / "layers").mkdir()
        layer_path, digest, _ = convert_image(img, work / "layers")

        sock = work / "sock"
        bs = subprocess.Popen([sys.executable, "-m", "host.storage.blockserver", "--socket-dir",
                               str(sock), "--state-dir", str(work / "state"), "--log-level",
                               "WARNING"], cwd=REPO, start_new_session=True)
        procs.append(bs)
        wait_for(sock / "control.sock", bs)
        client = SyncBlockServerClient(sock / "control.sock")
        client.import_layer(str(layer_path), upload=False)
        ours = client.create("bench", [digest]).nbd_uri

        qsd_sock = work / "qsd.sock"
        qsd = subprocess.Popen([
            "qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=f,filename={qsd_img}",
            "--nbd-server", f"addr.type=unix,addr.path={qsd_sock}",
            "--export", "type=nbd,id=e,node-name=f,name=img,writable=on",
        ], start_new_session=True)
        procs.append(qsd)
        wait_for(qsd_sock, qsd)
        targets = {"ours": ours, "qsd": f"nbd+unix:///img?socket={qsd_sock}", "raw": str(raw_img)}

        results: dict[str, dict[str, list[float]]] = {}
        for name, args, nbytes in workloads(size):
            results[name] = {t: [] for t in targets}
            for _ in range(a.runs):
                for t, target in targets.items():  # interleaved so drift hits all alike
                    secs = run_bench(target, args)
                    results[name][t].append(nbytes / secs / 1e6)

        print(f"storage bench: {a.size_mib} MiB image, qemu-img bench depth 4, writeback, "
              f"n={a.runs}")
        print(f"{'workload':<14} {'ours MB/s':>18} {'qsd MB/s':>18} {'raw MB/s':>18} "
              f"{'ours/qsd':>9} {'ours/raw':>9}")
        summary = {}
        for name, per in results.items():
            med = {t: statistics.median(v) for t, v in per.items()}
            p95 = {t: pct(v, 0.95) for t, v in per.items()}
            summary[name] = {"median_MBps": med, "p95_MBps": p95,
                             "ours/qsd": med["ours"] / med["qsd"],
                             "ours/raw": med["ours"] / med["raw"]}
            cells = [f"{med[t]:8.0f} (p95 {p95[t]:5.0f})" for t in ("ours", "qsd", "raw")]
            print(f"{name:<14} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} "
                  f"{med['ours'] / med['qsd']:8.2f}x {med['ours'] / med['raw']:8.2f}x")
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"params": {"size_mib": a.size_mib, "runs": a.runs,
                                              "depth": 4, "cache": "writeback",
                                              "step_4k": STEP_4K},
                                   "samples_MBps": results, "summary": summary}, indent=2))
        print(f"samples: {out}")
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
