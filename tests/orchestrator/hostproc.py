"""Runs `python -m host` as a subprocess for the VM-backed tests and inspects what it left
on the machine (QEMU processes, network namespaces, sockets, mounts, SQLite rows).

Every service gets its own state dir, run dir, ports, namespace prefix and address pool,
so it never touches another service's (or another test's) VMs and networks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HostService:
    def __init__(self, root: Path, *, prefix: str = "aot-", pool: str = "10.214.0.0/20",
                 memory_mb: int = 256, ttl_interval_s: float = 0.5,
                 extra: list[str] | None = None, tag: str = "aot") -> None:
        self.root = root
        self.state = root / "state"
        self.run = Path(f"/tmp/{tag}{os.getpid()}")
        self.extra = list(extra or [])  # more `python -m host` flags
        self.wrapper: list[str] = []  # argv before `python -m host` (it must exec it)
        self.scheme = "https" if "--tls" in self.extra else "http"
        self.prefix = prefix
        self.pool = pool
        self.memory_mb = memory_mb
        self.ttl_interval_s = ttl_interval_s
        # no warm VMs, and no VMs kept after pauses, unless a test asks: VM counts and
        # memory stay what the test made
        self.warm_pool = 0
        self.keep_paused_s = 0.0
        self.api_port = free_port()
        self.proxy_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def api_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.api_port}"

    @property
    def sandbox_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.proxy_port}"

    @property
    def ca_cert(self) -> Path:
        """The local CA of a --tls service."""
        return self.state / "tls" / "ca.pem"

    @property
    def api_key(self) -> str:
        return (self.state / "api_keys").read_text().split()[0]

    def start(self, timeout_s: float = 120.0) -> None:
        self.starts += 1
        log = open(self.root / f"service-{self.starts}.log", "wb")  # noqa: SIM115
        argv = [*self.wrapper, sys.executable, "-m", "host", *self.flags()]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        self.wait_healthy(timeout_s)

    def flags(self) -> list[str]:
        """The `python -m host` flags of this service."""
        return ["--state-dir", str(self.state),
                "--run-dir", str(self.run), "--api-port", str(self.api_port),
                "--proxy-port", str(self.proxy_port), "--memory-mb", str(self.memory_mb),
                "--network-prefix", self.prefix, "--network-pool", self.pool,
                "--ttl-interval", str(self.ttl_interval_s), "--warm-pool", str(self.warm_pool),
                "--keep-paused", str(self.keep_paused_s),
                # 20 concurrent TCG restores on a shared 2-core host can take minutes
                "--envd-timeout", "240", *self.extra]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> int | None:
        """The service's exit status once it has exited, else None."""
        return None if self.proc is None else self.proc.poll()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited() is not None:
                raise RuntimeError(f"host service exited {self.exited()}: {self.log()}")
            try:
                # the CA may not exist before the first start: /health is not about trust
                r = httpx.get(f"{self.api_url}/health", timeout=1, verify=False)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"host service did not come up: {self.log()}")

    def log(self, n: int = 4000) -> str:
        return (self.root / f"service-{self.starts}.log").read_text(errors="replace")[-n:]

    def client(self, timeout_s: float = 300.0) -> httpx.Client:
        verify: object = str(self.ca_cert) if self.scheme == "https" else True
        return httpx.Client(base_url=self.api_url, headers={"X-API-Key": self.api_key},
                            timeout=timeout_s, verify=verify)  # type: ignore[arg-type]

    def sigkill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self.proc = None
        return rc

    # ---- what is on the machine ----------------------------------------------------------

    def our_processes(self) -> dict[int, str]:
        """pid -> cmdline of processes started for this service (they name its dirs)."""
        out: dict[int, str] = {}
        marks = (str(self.run), str(self.state))
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmd for m in marks) and int(d.name) != os.getpid():
                out[int(d.name)] = cmd
        return out

    def qemu_pids(self) -> dict[int, str]:
        return {p: c for p, c in self.our_processes().items() if "qemu-system" in c}

    def vm_sandbox_ids(self) -> set[str]:
        ids = set()
        for cmd in self.qemu_pids().values():
            for part in cmd.split():
                if f"{self.run}/vms/" in part:
                    ids.add(part.split(f"{self.run}/vms/")[1].split("/")[0])
        return ids

    def netns(self) -> set[str]:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
        names = {ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()}
        return {n[len(self.prefix):] for n in names if n.startswith(self.prefix)}

    def vm_dirs(self) -> set[str]:
        vms = self.run / "vms"
        return {d.name for d in vms.iterdir()} if vms.is_dir() else set()

    def mounts(self) -> list[str]:
        text = Path("/proc/mounts").read_text()
        return [ln for ln in text.splitlines() if str(self.run) in ln or str(self.state) in ln]

    def db_states(self) -> dict[str, str]:
        db = sqlite3.connect(f"file:{self.state / 'state.db'}?mode=ro", uri=True)
        try:
            return dict(db.execute("SELECT id, state FROM sandboxes").fetchall())
        finally:
            db.close()

    def recovered_from(self, state: str) -> set[str]:
        """Sandboxes that recovery found in `state` (its events say so)."""
        db = sqlite3.connect(f"file:{self.state / 'state.db'}?mode=ro", uri=True)
        try:
            rows = db.execute("SELECT sandbox_id, detail FROM events").fetchall()
        finally:
            db.close()
        return {sid for sid, detail in rows
                if json.loads(detail).get("op") == "recovered"
                and json.loads(detail).get("from") == state}

    # ---- teardown ------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Kill every sandbox through the API, stop the service, then end whatever of ours
        is still running (by pid) and remove our namespaces and run dir."""
        if self.alive():
            try:
                with self.client(timeout_s=60) as c:
                    for sb in c.get("/v2/sandboxes", params={"state": "running,paused"}).json():
                        c.delete(f"/sandboxes/{sb['sandboxID']}")
            except Exception:  # noqa: BLE001, S110 - best effort, the steps below finish the job
                pass
        self.stop()
        for pid in self.our_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for sid in self.netns():
            subprocess.run(["ip", "netns", "delete", self.prefix + sid], check=False)
        for ln in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                                 check=False).stdout.splitlines():
            name = ln.split(":")[1].strip().split("@")[0] if ":" in ln else ""
            if name.startswith(self.prefix):
                subprocess.run(["ip", "link", "delete", name], check=False)
        table = "".join(c if c.isalnum() else "_" for c in self.prefix) + "host"
        subprocess.run(["nft", "delete", "table", "ip", table], capture_output=True,
                       check=False)
        shutil.rmtree(self.run, ignore_errors=True)
