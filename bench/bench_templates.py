"""Templates from OCI images: pull + import + build, against the floor, rebuilds, and
sandbox creates from the new template against creates from the built-in one, in one run.

    .venv/bin/python bench/bench_templates.py [--image debian|debian3|small] [--creates 5]
                                               [--min-free-mb N] [--no-builder] [--out FILE.json]

The image, pushed into a Debian `docker-registry` on 127.0.0.1 started here:
- `debian` (default, what RL task images look like): Debian 12 debootstrap'd with python3,
  pytest and git (tests/deploy/chroot.py builds it once from the Debian mirror and caches
  it), one gzip layer of ~100 MB;
- `debian3`: the same tree as three layers (the rest, /usr/lib/python3*, /usr/share), what
  a Dockerfile's steps make: the layers above the first apply through fuse2fs;
- `small`: a busybox layer and a layer of this host's Python standard library.
Its tar entries' mtimes (`--mtimes`): `docker` (default) truncated to the second with no
atime/ctime, as Docker's and BuildKit's layer writers (moby's and containerd's archive
packages) write every layer; `exact`: as GNU tar wrote them in the chroot, to the ns
(an image's first layer with sub-second mtimes goes through a tree, not straight into
`mke2fs -d -`: host/images/streamed.py).
Rows:

- floor: `skopeo copy docker://... dir:` of the same image (download + digest checks only)
- the node's first image build (a busybox image): it also makes the node's builder, the
  VM a build restores instead of cold-booting (host/runtime/builder.py; once per node
  and machine shape); `--no-builder`: every build VM cold-boots (the previous path)
- first build: pull + import (on the host, no VM: one block layer per OCI layer +
  init/envd) + build VM (restored from the builder, onto the image's disk) + two steps +
  memory snapshot, with the stage breakdown
- rebuild, nothing changed: reuses the ready build (no VM)
- rebuild, the last step changed: only that step runs (the rest cached)
- create from the new template vs from the built-in template (restore -> envd answers)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host.contract import BuildSpec, BuildStep, MachineSpec, NetworkConfig
from host.runtime import NodeRuntime, RuntimeConfig
from tests.images.conftest import _start, _stop
from tests.images.ocibuild import OciLayout, busybox_layer, push


def stdlib_layer() -> bytes:
    """A tar of this host's Python standard library under /usr/lib/pylib."""
    src = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname="usr/lib/pylib",
                filter=lambda ti: None if "__pycache__" in ti.name or "site-packages" in ti.name
                else ti)
    return buf.getvalue()


def debian_layer() -> bytes:
    """Debian 12 with python3, pytest and git, as one uncompressed tar."""
    import zstandard

    from tests.deploy.chroot import build_tarball
    tarball = build_tarball(("python3", "python3-pytest", "git"))
    with tarball.open("rb") as f:
        return zstandard.ZstdDecompressor().stream_reader(f).read()


def docker_like(tar: bytes) -> bytes:
    """`tar` as Docker and BuildKit write a layer: PAX, mtimes truncated to the second, no
    atime or ctime (for reproducible digests)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src:
            m.mtime = int(m.mtime)
            m.pax_headers = {k: v for k, v in m.pax_headers.items()
                             if k not in ("mtime", "atime", "ctime")}
            dst.addfile(m, src.extractfile(m) if m.isreg() else None)
    return out.getvalue()


def split_layers(tar: bytes) -> list[bytes]:
    """The same tree as three layers, as a Dockerfile's RUN steps would add them: the rest,
    then /usr/lib/python3*, then /usr/share (a hard link goes no lower than its target)."""
    def route(name: str) -> int:
        name = name.removeprefix("./")
        return 1 if name.startswith("usr/lib/python3") else \
            2 if name.startswith("usr/share/") else 0
    bufs = [io.BytesIO() for _ in range(3)]
    layer_of: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tarfile.open(fileobj=b, mode="w",
                                                 format=tarfile.PAX_FORMAT)) for b in bufs]
        src = stack.enter_context(tarfile.open(fileobj=io.BytesIO(tar), mode="r|"))
        for m in src:
            i = route(m.name)
            if m.islnk():
                i = max(i, layer_of.get(m.linkname, 0))
            layer_of[m.name] = i
            outs[i].addfile(m, src.extractfile(m) if m.isreg() else None)
    return [b.getvalue() for b in bufs]


def ms(s: float) -> str:
    return f"{s * 1e3:8.0f} ms"


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="aenv-btpl-", dir="/var/tmp"))
    (work / "registry").mkdir()
    reg = _start(work / "registry", htpasswd=None)
    res: dict[str, Any] = {}
    rt = await NodeRuntime(RuntimeConfig(
        state_dir=work / "state", run_dir=Path(f"/tmp/aenv-btpl-{work.name[-6:]}"),
        vms_survive_service=False, builders=args.builder)).open()
    try:
        layout = OciLayout(work / "layout")
        if args.image in ("debian", "debian3"):
            tree = debian_layer()
            if args.mtimes == "docker":
                tree = docker_like(tree)
            img = layout.image([tree] if args.image == "debian" else split_layers(tree), config={
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                "WorkingDir": "/srv"})
        else:
            img = layout.image([busybox_layer(), stdlib_layer()],
                               config={"Env": ["PATH=/bin"], "WorkingDir": "/srv"})
        res["image"] = args.image
        res["builder"] = args.builder
        res["mtimes"] = args.mtimes
        res["layers"] = len(img.layer_digests)
        push(layout.tag("app", img.manifest), f"{reg.host}/bench/app:1")
        ref = f"{reg.host}/bench/app:1"
        res["image_bytes"] = sum(p.stat().st_size for p in
                                 (work / "layout" / "blobs" / "sha256").iterdir())

        t0 = time.perf_counter()
        await asyncio.to_thread(
            subprocess.run, ["skopeo", "--insecure-policy", "copy", "-q",
                             "--src-tls-verify=false", f"docker://{ref}", f"dir:{work / 'floor'}"],
            check=True)
        res["floor_skopeo_s"] = time.perf_counter() - t0

        steps = (BuildStep("RUN", ("echo built > /srv/built.txt", "root")),
                 BuildStep("RUN", ("echo one > /srv/last.txt", "root")))
        machine = MachineSpec(memory_mb=256)
        warm = OciLayout(work / "warm")
        push(warm.tag("warm", warm.image([busybox_layer()], config={"Env": ["PATH=/bin"]})
                      .manifest), f"{reg.host}/bench/warm:1")
        t0 = time.perf_counter()
        await rt.build(BuildSpec(snapshot_id="bench-warm", machine=machine,
                                 from_image=f"{reg.host}/bench/warm:1",
                                 steps=(BuildStep("RUN", ("echo warm > /tmp/warm", "root")),),
                                 min_free_disk_mb=args.min_free_mb), lambda *a: None)
        res["node_first_build_s"] = time.perf_counter() - t0
        res["node_first_build_timings"] = dict(rt.last_timings)
        stages: list[tuple[float, str]] = []
        t0 = time.perf_counter()
        await rt.build(BuildSpec(snapshot_id="bench-img", machine=machine, from_image=ref,
                                 steps=steps, min_free_disk_mb=args.min_free_mb),
                       lambda lvl, msg, step: stages.append((time.perf_counter() - t0, msg)))
        res["first_build_s"] = time.perf_counter() - t0
        res["first_build_timings"] = dict(rt.last_timings)
        res["first_build_stages"] = [(round(t, 2), m) for t, m in stages
                                     if not m.startswith(("Copying", "Writing"))][:40]
        t0 = time.perf_counter()
        again = await rt.build(BuildSpec(snapshot_id="bench-img2", machine=machine,
                                         from_image=ref, steps=steps,
                                         min_free_disk_mb=args.min_free_mb), lambda *a: None)
        res["cached_build_s"] = time.perf_counter() - t0
        res["cached_build_reused"] = again.facts["build"].get("reused")
        changed = (*steps[:-1], BuildStep("RUN", ("echo two > /srv/last.txt", "root")))
        t0 = time.perf_counter()
        third = await rt.build(BuildSpec(snapshot_id="bench-img3", machine=machine,
                                         from_image=ref, steps=changed,
                                         min_free_disk_mb=args.min_free_mb), lambda *a: None)
        res["one_step_build_s"] = time.perf_counter() - t0
        res["one_step_cached_steps"] = third.facts["build"]["cached_steps"]
        res["one_step_timings"] = dict(rt.last_timings)

        base = await rt.build_template("bench-base", machine)
        new = await rt.find_snapshot("bench-img")
        assert new is not None
        for name, snap in (("builtin", base), ("image", new)):
            times = []
            for i in range(args.creates):
                t = time.perf_counter()
                await rt.start(f"bc-{name[:3]}{i}", snap, NetworkConfig())
                times.append(time.perf_counter() - t)
                await rt.kill(f"bc-{name[:3]}{i}")
            res[f"create_{name}_s"] = times
    finally:
        await rt.shutdown()
        _stop(reg.proc)
        shutil.rmtree(work, ignore_errors=True)
    return res


def report(r: dict[str, Any]) -> None:
    print(f"image: {r['image']}, {r['layers']} layers, {r['image_bytes'] / 2**20:.1f} MiB "
          f"compressed, mtimes {r.get('mtimes', 'exact')}")
    print(f"floor: skopeo copy to dir            {ms(r['floor_skopeo_s'])}")
    print(f"node's first image build (busybox)   {ms(r['node_first_build_s'])}   "
          f"({'makes the node builder' if r['builder'] else 'no builder: cold boots'}: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in r["node_first_build_timings"].items()
                      if k in ("source_s", "cold_boot_s", "builder_restore_s")) + ")")
    print(f"first build (pull+import+build)      {ms(r['first_build_s'])}   "
          f"{r['first_build_s'] / r['floor_skopeo_s']:.1f}x the floor")
    boot_at = next((at for at, msg in r["first_build_stages"]
                    if msg.startswith(("Booting the build VM", "Restoring the build VM"))),
                   None)
    if boot_at is not None:
        print(f"  pull + import (until the build VM starts) {ms(boot_at)}   "
              f"{boot_at / r['floor_skopeo_s']:.1f}x the floor; build VM "
              f"{ms(r['first_build_s'] - boot_at)}")
    t = r["first_build_timings"]
    print("  build VM stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items()))
    for at, msg in r["first_build_stages"]:
        print(f"  {at:7.2f}s  {msg[:90]}")
    print(f"rebuild, nothing changed             {ms(r['cached_build_s'])}   "
          f"{r['cached_build_s'] / r['first_build_s']:.3f}x the first build "
          f"(reused {r['cached_build_reused']}; target <= 0.1x)")
    print(f"rebuild, last step changed           {ms(r['one_step_build_s'])}   "
          f"{r['one_step_build_s'] / r['first_build_s']:.2f}x the first build "
          f"({r['one_step_cached_steps']} of 2 steps cached)")
    print("  stages: " + ", ".join(f"{k} {v:.2f}s" for k, v in r["one_step_timings"].items()))
    b, i = statistics.median(r["create_builtin_s"]), statistics.median(r["create_image_s"])
    print(f"create from built-in template p50    {ms(b)}  (n={len(r['create_builtin_s'])})")
    print(f"create from image template p50       {ms(i)}   {i / b:.2f}x the built-in")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=5)
    ap.add_argument("--no-builder", dest="builder", action="store_false",
                    help="every build VM cold-boots (the path before the node's builder)")
    ap.add_argument("--image", choices=("debian", "debian3", "small"), default="debian")
    ap.add_argument("--mtimes", choices=("docker", "exact"), default="docker")
    ap.add_argument("--min-free-mb", type=int, default=0,
                    help="the builds' minFreeDiskMb (past the image's 4 GiB: the disk grows)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    r = asyncio.run(amain(args))
    report(r)
    if args.out:
        args.out.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
