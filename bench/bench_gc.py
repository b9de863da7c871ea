"""Storage soak: N sandbox lifecycles against a real service, then everything killed and
one collection (`POST /admin/gc`, what `aenv gc` calls): the state dir and the node's
repository should come back to their size after the warm-up round, file counts per kind
printed before and after, with the service's and the block server's fds and RSS.

Each lifecycle: create; write 1 MiB and sync; pause and resume 3 times (a write before
each); fork --fork children (4); a named snapshot, then its delete; kill every sandbox.
Every --build-every lifecycles (30) also a template build through the SDK's Template API
(a RUN and a COPY of a new file: a new archive and new cache entries), then its delete.
The anchor is the warm-up state (--warm-up lifecycles and one build, collected): a leak
shows as growth over it. RSS is also sampled every 10 lifecycles: a leak climbs steadily,
the heap's high-water mark levels off. `--repo oss` puts the repository in a real moto S3 server process and
counts its objects per kind too. `--collect-every K` also collects every K lifecycles (after
that lifecycle's sample), as the node's collector does every --gc-interval in service: the
steady state, where what a collection frees is reused by the lifecycles after it.

    .venv/bin/python bench/bench_gc.py [-n 30] [--repo posix|oss] [--collect-every K]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.conftest import E2EService, build_template

KINDS = {"layers": ("storage/layers", "*.lsmt"), "uppers": ("storage/uppers", "*"),
         "stacks": ("storage/stacks", "*.json"), "memory": ("memory", "*"),
         "repository_layers": ("repo/layers", "*.lsmt"),
         "repository_memory": ("repo/files/memory", "*"),
         "manifests": ("repo/manifests", "*.json"), "vmlogs": ("vmlogs", "*")}


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_blocks * 512
        except OSError:
            continue
    return total


def usage(state: Path) -> dict[str, tuple[int, int]]:
    """(entries, bytes) per kind; `state dir` is everything, hard links counted once."""
    out: dict[str, tuple[int, int]] = {}
    for kind, (sub, pattern) in KINDS.items():
        d = state / sub
        entries = list(d.glob(pattern)) if d.is_dir() else []
        out[kind] = (len(entries), sum(_bytes(e) for e in entries))
    seen: set[tuple[int, int]] = set()
    total = 0
    for f in state.rglob("*"):
        try:
            st = f.lstat()
        except OSError:
            continue
        if f.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    out["state dir"] = (len(seen), total)
    return out


def bucket_usage(spec: str) -> dict[str, tuple[int, int]]:
    """(objects, bytes) per kind of an oss repository."""
    from urllib.parse import parse_qs, urlparse

    import boto3

    u = urlparse(spec)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    s3 = boto3.client("s3", endpoint_url=q["endpoint"], region_name=q["region"])
    prefix = u.path.strip("/") + "/"
    out = {k: (0, 0) for k in ("oss layers", "oss memory", "oss manifests", "oss other")}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=u.netloc, Prefix=prefix):
        for o in page.get("Contents", []):
            key = o["Key"][len(prefix):]
            kind = ("oss layers" if key.startswith("layers/") else
                    "oss memory" if key.startswith("files/memory/") else
                    "oss manifests" if key.startswith("manifests/") else "oss other")
            n, b = out[kind]
            out[kind] = (n + 1, b + int(o["Size"]))
    return out


def proc_stats(pid: int) -> tuple[int, int]:
    """(open fds, RSS KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
               if ln.startswith("VmRSS:"))
    return fds, rss


def block_server_pid(state: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"host.storage.blockserver" in cmd and str(state).encode() in b" ".join(cmd):
                return int(d.name)
    return None


class Soak:
    def __init__(self, svc: E2EService, forks: int) -> None:
        self.svc = svc
        self.forks = forks
        self.client = svc.client(timeout_s=600)
        from e2b import Sandbox
        self.Sandbox = Sandbox

    def call(self, method: str, path: str, ok: tuple[int, ...], **kw: Any) -> Any:
        r = self.client.request(method, path, **kw)
        if r.status_code not in ok:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")
        return r.json() if r.content else None

    def run_cmd(self, sid: str, cmd: str) -> None:
        self.Sandbox.connect(sid).commands.run(cmd, timeout=120)

    def build(self, i: int, context: Path) -> None:
        """A template build (RUN + COPY of a file new to this build), then its delete."""
        from e2b import Template

        (context / "data.txt").write_text(f"build {i}\n" * 1000)
        t = (Template(file_context_path=str(context)).from_template("base")
             .run_cmd(f"head -c 512K /dev/urandom > /home/user/built-{i}")
             .copy("data.txt", "/home/user/"))
        info = Template.build(t, f"soak-{i}")
        self.call("DELETE", f"/templates/{info.template_id}", (204,))

    def lifecycle(self, i: int) -> None:
        sid = self.call("POST", "/v2/sandboxes", (201,),
                        json={"templateID": "base", "timeout": 600})["sandboxID"]
        kids: list[str] = []
        try:
            for r in range(3):
                self.run_cmd(sid, f"head -c 1M /dev/urandom > /home/user/f{i}-{r} && sync")
                self.call("POST", f"/sandboxes/{sid}/pause", (204,))
                self.call("POST", f"/sandboxes/{sid}/connect", (200, 201), json={"timeout": 600})
            forks = self.call("POST", f"/sandboxes/{sid}/fork", (201,),
                              json={"count": self.forks, "timeout": 600})
            kids = [f["sandbox"]["sandboxID"] for f in forks if f.get("sandbox")]
            snap = self.call("POST", f"/sandboxes/{sid}/snapshots", (201,),
                             json={"name": f"soak-{i}"})
            self.call("DELETE", f"/templates/{snap['snapshotID']}", (204,))
        finally:
            for s in (*kids, sid):
                self.client.delete(f"/sandboxes/{s}")

    def collect(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("POST", "/admin/gc", (200,))
        return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=30, help="lifecycles after the warm-up one")
    ap.add_argument("--fork", type=int, default=4, help="children forked per lifecycle")
    ap.add_argument("--build-every", type=int, default=30,
                    help="a template build + delete every this many lifecycles (0: none)")
    ap.add_argument("--repo", choices=("posix", "oss"), default="posix")
    ap.add_argument("--warm-up", type=int, default=5,
                    help="lifecycles before the anchor (the heap's first growth is there)")
    ap.add_argument("--collect-every", type=int, default=0,
                    help="a collection every this many lifecycles too (0: only at the end)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.json = args.json or REPO / f"out/bench/gc-{args.repo}.json"
    root = Path(tempfile.mkdtemp(prefix="aenv-bench-gc-", dir="/var/tmp"))
    context = root / "context"
    context.mkdir()
    saved = dict(os.environ)
    with contextlib.ExitStack() as stack:
        # collections only when asked, of anything unused however young, killed rows and
        # unused build caches at once
        extra = ["--gc-interval", "0", "--gc-min-age", "0", "--retain-killed", "0",
                 "--build-cache-ttl", "0"]
        spec = None
        if args.repo == "oss":
            import boto3

            from tests.conftest import moto_server

            os.environ.update({"AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing"})
            endpoint = stack.enter_context(moto_server(root))
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
                Bucket="soak")
            spec = f"oss://soak/aenv?endpoint={endpoint}&region=us-east-1"
            extra += ["--repository", spec]

        def measure() -> dict[str, tuple[int, int]]:
            return {**usage(svc.state), **(bucket_usage(spec) if spec else {})}

        svc = E2EService(root, pool="10.216.80.0/20", tag="agc", extra=extra)
        try:
            svc.start()
            print(f"template build + first create: {build_template(svc):.1f} s", flush=True)
            os.environ.update(svc.sdk_env())
            os.environ["E2B_DOMAIN"] = "sbx.localhost"
            soak = Soak(svc, args.fork)
            assert svc.proc is not None
            for i in range(args.warm_up):
                soak.lifecycle(100000 + i)
            if args.build_every:
                soak.build(0, context)
            soak.collect()
            before, bs_pid = measure(), block_server_pid(svc.state)
            svc_before = proc_stats(svc.proc.pid)
            bs_before = proc_stats(bs_pid) if bs_pid else (0, 0)
            t0 = time.monotonic()
            builds = 0
            rss: list[tuple[int, int, int]] = [(0, svc_before[1], bs_before[1])]
            for i in range(1, args.n + 1):
                soak.lifecycle(i)
                if args.build_every and i % args.build_every == 0:
                    soak.build(i, context)
                    builds += 1
                if i % 10 == 0:
                    rss.append((i, proc_stats(svc.proc.pid)[1],
                                proc_stats(bs_pid)[1] if bs_pid else 0))
                    print(f"  {i}/{args.n} lifecycles, {time.monotonic() - t0:.0f} s; state "
                          f"dir {usage(svc.state)['state dir'][1] / 2**20:.0f} MiB before "
                          f"collection", flush=True)
                if args.collect_every and i % args.collect_every == 0 and i < args.n:
                    soak.collect()
            grown = measure()
            report = soak.collect()
            after = measure()
            svc_after = proc_stats(svc.proc.pid)
            bs_after = proc_stats(bs_pid) if bs_pid else (0, 0)
            print(f"\n{args.n} lifecycles (fork {args.fork}) and {builds} template builds in "
                  f"{time.monotonic() - t0:.0f} s (TCG), repository {args.repo}, collections "
                  f"{f'every {args.collect_every} and ' if args.collect_every else ''}at the "
                  f"end; last collection "
                  f"{report['seconds']:.2f} s, records {report['records']}")
            print(f"  {'kind':18} {'warm-up':>16} {'before gc':>16} {'after gc':>16} "
                  f"{'after/warm-up':>14}")
            for kind in after:
                (n0, b0), (n1, b1), (n2, b2) = before[kind], grown[kind], after[kind]
                ratio = f"{b2 / b0:.2f}x" if b0 else ("1.00x" if b2 == 0 else "new")
                print(f"  {kind:18} {n0:5} {b0 / 2**20:8.1f} MiB {n1:5} {b1 / 2**20:8.1f} MiB "
                      f"{n2:5} {b2 / 2**20:8.1f} MiB {ratio:>14}")
            print(f"  service fds/RSS: {svc_before[0]}/{svc_before[1] // 1024} MiB -> "
                  f"{svc_after[0]}/{svc_after[1] // 1024} MiB; block server: {bs_before[0]}/"
                  f"{bs_before[1] // 1024} MiB -> {bs_after[0]}/{bs_after[1] // 1024} MiB "
                  "(after the collection)")
            print("  RSS MiB (service, block server) every 10 lifecycles, before collection: "
                  + " ".join(f"{n}:{a // 1024}/{b // 1024}" for n, a, b in rss))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"bench": "gc", "n": args.n, "repo": args.repo,
                                             "collect_every": args.collect_every,
                                             "fork": args.fork, "builds": builds,
                                             "warm_up": before, "before_gc": grown,
                                             "after_gc": after, "report": report,
                                             "rss_kib": rss, "service": [svc_before, svc_after],
                                             "block_server": [bs_before, bs_after]},
                                            indent=1, default=str) + "\n")
            return 0
        finally:
            os.environ.clear()
            os.environ.update(saved)
            svc.cleanup()
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
