"""The Docker deploy restarted for real (issue 35): the node image built by a Docker daemon
the test starts (tests/deploy/dockerd.py), a node run from it as deploy/README.md says, 10
running sandboxes (a file each, a background process each, one serving HTTP through the
proxy), then `docker restart`: the container's SIGTERM drains the node (its VMs die with
the container), and the restarted container resumes every sandbox with its file, its
process and its server; nothing of the VMs from before is left on the machine.

The container runs `--privileged` where this machine's capability bounding set allows it.
Where it does not (this build machine's lacks CAP_SYS_RESOURCE, so runc cannot grant it
and `--privileged` fails with "unable to apply caps"), it gets what `--privileged` gives
less the capabilities the machine lacks: every other capability, every device, no seccomp
or AppArmor profile, unmasked /proc, the host's cgroup hierarchy writable. It shares the
host's network (this daemon has no bridge), listening on loopback.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import fleet as fleet_of
from tests.e2e.conftest import E2EService, build_template, need_vm, use_sdk

from . import chroot, dockerd

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(5400)]

DOCKERFILE = dockerd.REPO / "deploy" / "docker" / "Dockerfile.node"
IMAGE = "aenv-node:test"
# linux/capability.h, in bit order: the names `docker --cap-drop` takes
CAPS = ("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID",
        "SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST",
        "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO",
        "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE",
        "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM",
        "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE")


def privileges() -> list[str]:
    """`docker run` flags for a node container on this machine (see the module's text)."""
    status = Path("/proc/self/status").read_text()
    m = re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.MULTILINE)
    assert m, status
    bounding = int(m.group(1), 16)
    lacking = [name for bit, name in enumerate(CAPS) if not bounding >> bit & 1]
    if not lacking:
        return ["--privileged"]
    return ["--cap-add", "ALL", *[a for name in lacking for a in ("--cap-drop", name)],
            "--security-opt", "seccomp=unconfined", "--security-opt", "apparmor=unconfined",
            "--security-opt", "systempaths=unconfined", "--device-cgroup-rule", "a *:* rwm",
            "-v", "/dev:/dev", "-v", "/sys/fs/cgroup:/sys/fs/cgroup"]


class DockerNode(E2EService):
    """The node as a container of `image` (its entrypoint, `python -m host`), with the
    state and run dirs bind-mounted at their host paths (so the inspection helpers of
    HostService see its files and QEMU processes as they are) and the guest kernel and
    images from this machine's cache."""

    def __init__(self, root: Path, d: dockerd.Dockerd, image: str) -> None:
        super().__init__(root, prefix="aedkr-", pool="10.216.160.0/20", tag="aedkr")
        self.d = d
        self.image = image
        self.name = f"aenv-node-test-{os.getpid()}"
        self.created = False

    def start(self, timeout_s: float = 300.0) -> None:
        self.starts += 1
        if self.created:
            self.d.docker("start", self.name)
        else:
            self.state.mkdir(parents=True, exist_ok=True)
            self.run.mkdir(parents=True, exist_ok=True)
            cache = chroot.cache_dir().parent
            self.d.docker("run", "-d", "--name", self.name, "--network", "host",
                          "--stop-timeout", "600", *privileges(),
                          "-v", f"{self.state}:{self.state}", "-v", f"{self.run}:{self.run}",
                          "-v", f"{cache}:/var/cache/aenv",
                          self.image, "--listen", "127.0.0.1", *self.flags())
            self.created = True
        self.wait_healthy(timeout_s)

    def _inspect(self, fmt: str) -> str:
        return self.d.docker("inspect", "-f", fmt, self.name).stdout.strip()

    def alive(self) -> bool:
        return self.created and self._inspect("{{.State.Running}}") == "true"

    def exited(self) -> int | None:
        return None if self.alive() else int(self._inspect("{{.State.ExitCode}}"))

    def log(self, n: int = 4000) -> str:
        if not self.created:
            return ""
        r = self.d.docker("logs", self.name, check=False)
        return (r.stdout + r.stderr)[-n:]

    def stop(self, timeout_s: float = 600.0) -> int | None:
        if not self.alive():
            return None
        self.d.docker("stop", "-t", str(int(timeout_s)), self.name, timeout=timeout_s + 60)
        return self.exited()

    def restart(self, timeout_s: float = 600.0) -> None:
        """`docker restart`: SIGTERM, the grace period, then a start of the same container."""
        self.d.docker("restart", "-t", str(int(timeout_s)), self.name, timeout=timeout_s + 60)
        self.starts += 1
        self.wait_healthy(300)

    def pids(self) -> set[int]:
        """Host pids of every process in the container (service, block server, VMs)."""
        out = self.d.docker("top", self.name, "-eo", "pid").stdout.split()
        return {int(p) for p in out[1:]}

    def signal(self, sig: str) -> None:
        self.d.docker("kill", "-s", sig, self.name)

    def cleanup(self) -> None:
        super().cleanup()
        if self.created:
            self.d.docker("rm", "-f", self.name, check=False)


@pytest.fixture(scope="module")
def node() -> Iterator[DockerNode]:
    why = dockerd.available()
    if why:
        pytest.skip(why)
    need_vm()
    with dockerd.running("aenv-dkr") as d:
        t0 = time.monotonic()
        dockerd.build(d, DOCKERFILE, IMAGE, target="node")
        print(f"\nnode image built (or found in the build cache) in "
              f"{time.monotonic() - t0:.0f} s")
        root = Path(tempfile.mkdtemp(prefix="aenv-dkr-", dir="/var/tmp"))
        s = DockerNode(root, d, IMAGE)
        try:
            s.start()
            build_template(s)
            yield s
        finally:
            s.cleanup()
            chroot.remove_root(root)


def test_docker_restart_resumes_every_sandbox(node: DockerNode,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import Sandbox

    use_sdk(node, monkeypatch)
    fleet = fleet_of.make(node, 10)
    ids = fleet.ids
    before = node.qemu_pids()
    assert len(before) == 10, before
    processes = node.pids()

    t0 = time.monotonic()
    node.restart()
    restart_s = time.monotonic() - t0
    log = node.log(10_000_000)
    m = re.search(r"drain: (\d+) sandboxes paused, (\d+) failed, \d+ spare VMs released, "
                  r"in ([\d.]+) s", log)
    assert m and m.group(1, 2) == ("10", "0"), log[-4000:]
    print(f"\ndocker restart of a node with 10 running sandboxes: {restart_s:.1f} s "
          f"(drain {m.group(3)} s, exit, start, healthy)")
    # nothing of the old container runs on: service, block server, VMs
    assert not processes & node.pids()

    t1 = time.monotonic()
    deadline = t1 + 900
    while not all(node.db_states().get(sid) == "running" for sid in ids):
        assert time.monotonic() < deadline, (node.db_states(), node.log())
        time.sleep(0.5)
    print(f"the restarted container resumed all 10 in {time.monotonic() - t1:.1f} s")
    # the VMs from before died with the old container; ten new ones, nothing else
    now = node.qemu_pids()
    assert not set(before) & set(now) and len(now) == 10, (before, now)
    fleet_of.check_resumed(fleet)
    for sid in ids:
        Sandbox.kill(sid)


def test_a_container_killed_mid_drain_loses_no_sandbox(
        node: DockerNode, monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker kill` (SIGKILL: the container ends with its VMs) once the drain paused its
    first sandbox: after `docker start`, each sandbox runs (its pause was committed) or is
    paused with its disk (recovered), and has its file."""
    use_sdk(node, monkeypatch)
    ids = fleet_of.with_files(6)
    mark = len(node.log(10_000_000))
    node.signal("TERM")
    deadline = time.monotonic() + 600
    while "drain: sandbox" not in node.log(10_000_000)[mark:]:
        assert time.monotonic() < deadline and node.alive(), node.log()
        time.sleep(0.05)
    node.signal("KILL")
    deadline = time.monotonic() + 60
    while node.alive():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert node.qemu_pids() == {}
    node.start()
    deadline = time.monotonic() + 900
    while not all(node.db_states().get(sid) in ("running", "paused") for sid in ids):
        assert time.monotonic() < deadline, (node.db_states(), node.log())
        time.sleep(0.5)
    states = node.db_states()
    print(f"\nafter docker kill mid-drain: {sorted(states[sid] for sid in ids)}")
    fleet_of.check_files_and_kill(ids)
