"""A Docker daemon of the tests' own, and the images the deploy's Dockerfiles build on it.

Debian's `docker.io` (dockerd 20.10) is started by the tests, on a private socket, exec
root and data root, with no bridge and no iptables rules of its own (the containers use the
host's network): nothing of the machine's own Docker setup, if it has one, is touched. The
data root lives under `$AENV_CACHE/docker-test` so image layers and the build cache survive
between runs (a rebuild with the same inputs is a cache hit).

No registry can be reached from here, so `debian:bookworm-slim` (the Dockerfiles' base) is
made locally: the same debootstrap'd Debian 12 minbase root the install tests use
(chroot.py), with this machine's CA certificates and pip configuration (chroot.prepare: an
egress proxy may sign TLS with its own CA), imported under that name.

The client is the `docker` CLI; BuildKit needs the buildx plugin, which Debian 12 does not
ship, so images are built by the classic builder. It reads `.dockerignore` at the root of
the context only, so the context is made here: the repository's tracked files as they are
in the work tree, with `<Dockerfile>.dockerignore` (what BuildKit would read) placed as the
context's `.dockerignore`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import chroot

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "debian:bookworm-slim"
# npm and pip carry their own CA lists: point them at the system's, which prepare() extended
BASE_ENV = ("NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt",
            "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")


def available() -> str | None:
    """Why this machine cannot run the daemon, or None when it can."""
    for tool in ("dockerd", "docker", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: docker.io, debootstrap)"
    return None


class Dockerd:
    """One running dockerd; `docker(...)` runs the CLI against it."""

    def __init__(self, root: Path, run_dir: Path) -> None:
        self.root = root
        self.run_dir = run_dir
        self.socket = run_dir / "docker.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def docker(self, *args: str, timeout: float = 600, check: bool = True,
               input_bytes: bytes | None = None) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(["docker", *args], input=input_bytes, capture_output=True,
                           timeout=timeout, env=self.env, check=False)
        out = subprocess.CompletedProcess(p.args, p.returncode,
                                          p.stdout.decode(errors="replace"),
                                          p.stderr.decode(errors="replace"))
        if check and p.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} exited {p.returncode}:\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def start(self, timeout_s: float = 120) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.run_dir / "dockerd.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.root), "--exec-root", str(self.run_dir / "exec"),
             "--pidfile", str(self.run_dir / "dockerd.pid"), "--host", f"unix://{self.socket}",
             "--iptables=false", "--ip6tables=false", "--bridge=none"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while self.docker("info", check=False, timeout=30).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: {self.log()}")
            time.sleep(0.5)

    def log(self, n: int = 4000) -> str:
        return (self.run_dir / "dockerd.log").read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@contextlib.contextmanager
def running(tag: str) -> Iterator[Dockerd]:
    """A dockerd for the duration; its containers are removed and it is stopped after."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/run"))
    d = Dockerd(chroot.cache_dir().parent / "docker-test", run_dir)
    try:
        d.start()
        yield d
    finally:
        if d.proc is not None:
            ids = d.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                d.docker("rm", "-f", *ids, check=False, timeout=300)
        d.stop()
        for point in chroot.mounts_under(run_dir):  # dockerd leaves exec/netns/default
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)
        chroot.remove_root(run_dir)


def ensure_base_image(d: Dockerd) -> None:
    """`debian:bookworm-slim` from the cached debootstrap root, once per root (its key is
    the image's label)."""
    tarball = chroot.build_tarball(())
    key = tarball.parent.name
    r = d.docker("image", "inspect", "-f", '{{index .Config.Labels "aenv.root"}}', BASE_IMAGE,
                 check=False)
    if r.returncode == 0 and r.stdout.strip() == key:
        return
    with tempfile.TemporaryDirectory(prefix="aenv-base-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "root"
        try:
            chroot.unpack(tarball, root)
            chroot.prepare(root)
            tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "--xattrs",
                                    "-c", "."], stdout=subprocess.PIPE)
            assert tar.stdout is not None
            changes = [a for env in BASE_ENV for a in ("--change", f"ENV {env}")]
            p = subprocess.run(["docker", "import", *changes, "--change",
                                f"LABEL aenv.root={key}", "-", BASE_IMAGE],
                               stdin=tar.stdout, capture_output=True, env=d.env, timeout=600,
                               check=False)
            tar.stdout.close()
            if tar.wait() != 0 or p.returncode != 0:
                raise RuntimeError(f"docker import failed: {p.stderr.decode()[-3000:]}")
        finally:
            chroot.remove_root(root)


def build_context(dockerfile: Path) -> bytes:
    """The build context as a tar: tracked files from the work tree, and the Dockerfile's
    own ignore file as `.dockerignore` (the classic builder reads only that one)."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    buf = io.BytesIO()
    # GNU, not PAX: the CLI tells a tar context from a Dockerfile on stdin by parsing the
    # first header from the first 512 bytes, and a PAX header (Python writes one for a
    # fractional mtime) needs the block after it
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        if ignore.is_file():
            tar.add(ignore, arcname=".dockerignore")
        for name in files:
            path = REPO / name
            if name and (path.is_file() or path.is_symlink()):  # a deleted file is no input
                tar.add(path, arcname=name, recursive=False)
    return buf.getvalue()


def build(d: Dockerd, dockerfile: Path, tag: str, *, target: str | None = None,
          timeout: float = 3600) -> str:
    """Build `dockerfile` (a path in the repository) as `tag`; returns the build's output.
    The steps reach the network through the host's (apt, pip, npm)."""
    ensure_base_image(d)
    rel = dockerfile.resolve().relative_to(REPO)
    args: Sequence[str] = ["build", "--network", "host", "-f", str(rel), "-t", tag,
                           *(["--target", target] if target else []), "-"]
    return d.docker(*args, input_bytes=build_context(dockerfile), timeout=timeout).stdout
