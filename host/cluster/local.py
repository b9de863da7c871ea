"""`make cluster`: a whole cluster on this machine, for trying it and for the VM tests.

Starts Redis, the scheduler, the gateway and N nodes (`python -m host`), each node in its
own network namespace (`<prefix><i>`, reached from the host over a veth pair:
`<subnet>.<i>.1` host side, `<subnet>.<i>.2` the node), all nodes on one `posix_fs`
repository, every service with the same API key and node key (its own secret: the
gateway's and scheduler's calls into nodes). Prints the `E2B_*` exports for the
gateway and, on Ctrl+C (or `stop()`), stops everything it started: the nodes' sandboxes
are killed first (a node's SIGTERM leaves its VMs running for the next start to adopt),
then the services, the namespaces and a temporary root.

Processes are plain subprocesses (`nsenter --net` for the nodes: only the network
namespace changes, so a node's own namespaces and mounts are the host's, as in
production). Logs are in `<root>/logs/`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from host.api.auth import new_node_key
from host.private import create_private, private_dir

REPO = Path(__file__).resolve().parents[2]
NODE_API_PORT, NODE_PROXY_PORT = 3000, 3001


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    health: str | None = None


@dataclass
class LocalCluster:
    nodes: int = 3
    root: Path | None = None            # None: a temporary directory, removed at stop
    prefix: str = "acl"                 # namespace / veth / node network names
    subnet: str = "10.250"              # node i: <subnet>.<i>.{1,2}/30
    pool_base: int = 224                # node i's guest pool: 10.<pool_base + i>.0.0/20
    gateway_port: int = 8080
    scheduler_port: int = 9090
    redis_port: int = 6390
    # round-robin: the nodes share this one machine and report the same memory and load,
    # so least-loaded (the default of a real cluster) could not tell them apart
    strategy: str = "round-robin"
    node_args: list[str] = field(default_factory=list)  # more `python -m host` flags
    # the nodes' shared repository (default: posix_fs in the root); `{host}` becomes the
    # host's address as node i reaches it (an oss endpoint served on this machine)
    repository: str | None = None
    procs: list[Proc] = field(default_factory=list)
    node_procs: dict[int, Proc] = field(default_factory=dict)
    _temp: bool = False
    _redis_password: str = field(default_factory=lambda: secrets.token_hex(16))
    _specs: dict[str, tuple[list[str], str | None, str | None]] = field(default_factory=dict)

    # --- addresses ----------------------------------------------------------------------

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{i}.2"

    def host_addr(self, i: int) -> str:
        return f"{self.subnet}.{i}.1"

    def netns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def api_key(self) -> str:
        assert self.root is not None
        return (self.root / "api_keys").read_text().split()[0]

    def exports(self) -> str:
        return "\n".join([
            f"export E2B_API_URL={self.gateway_url}",
            f"export E2B_SANDBOX_URL={self.gateway_url}",
            f"export E2B_API_KEY={self.api_key}",
        ])

    # --- start --------------------------------------------------------------------------

    def start(self) -> None:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="aenv-cluster-", dir="/var/tmp"))
            self._temp = True
        private_dir(self.root)
        (self.root / "logs").mkdir(exist_ok=True)
        keys = self.root / "api_keys"
        create_private(keys, f"e2b_{secrets.token_hex(20)}\n".encode())
        node_key = self.root / "node_key"
        create_private(node_key, (new_node_key() + "\n").encode())
        try:
            for i in range(1, self.nodes + 1):
                self._add_netns(i)
            self._start_redis()
            py = [sys.executable, "-m"]
            self._spawn("scheduler", [*py, "host.cluster.scheduler",
                                      "--strategy", self.strategy,
                                      "--listen", f"127.0.0.1:{self.scheduler_port}",
                                      "--node-key-file", str(node_key)],
                        health=f"http://127.0.0.1:{self.scheduler_port}/health",
                        redis_host="127.0.0.1")
            self._spawn("gateway", [*py, "host.cluster.gateway",
                                    "--listen", f"127.0.0.1:{self.gateway_port}",
                                    "--scheduler", f"http://127.0.0.1:{self.scheduler_port}",
                                    "--keys", str(keys), "--node-key-file", str(node_key)],
                        health=None,  # healthy once a node heartbeats: waited for below
                        redis_host="127.0.0.1")
            for i in range(1, self.nodes + 1):
                self.start_node(i)
            self._wait_nodes_ready()
        except BaseException:
            self.stop()
            raise

    def start_node(self, i: int) -> Proc:
        """(Re)start node `i` in its namespace; returns once its API answers."""
        assert self.root is not None
        state = self.root / f"node{i}"
        private_dir(state)
        for name in ("api_keys", "node_key"):   # each node's copy, as on its own machine
            shutil.copyfile(self.root / name, state / name)
            os.chmod(state / name, 0o600)
        repo = self.root / "repo"
        repo.mkdir(exist_ok=True)
        argv = ["nsenter", f"--net=/run/netns/{self.netns(i)}", "--",
                sys.executable, "-m", "host", "--state-dir", str(state),
                "--run-dir", f"/run/{self.prefix}-n{i}", "--listen", self.node_addr(i),
                "--api-port", str(NODE_API_PORT), "--proxy-port", str(NODE_PROXY_PORT),
                "--repository", (self.repository.replace("{host}", self.host_addr(i))
                                 if self.repository else f"posix_fs:{repo}"),
                "--node-id", f"node{i}",
                "--advertise-url", f"http://{self.node_addr(i)}:{NODE_API_PORT}",
                "--advertise-proxy-url", f"http://{self.node_addr(i)}:{NODE_PROXY_PORT}",
                "--network-prefix", f"{self.prefix}{i}-",
                "--network-pool", f"10.{self.pool_base + i}.0.0/20", *self.node_args]
        proc = self._spawn(f"node{i}", argv,
                           health=f"http://{self.node_addr(i)}:{NODE_API_PORT}/health",
                           redis_host=self.host_addr(i))
        self.node_procs[i] = proc
        return proc

    def _add_netns(self, i: int) -> None:
        ns, host_if, node_if = self.netns(i), f"{self.prefix}{i}h", f"{self.prefix}{i}n"
        self._del_netns(i)  # a leftover of a run that was killed
        for argv in (["ip", "netns", "add", ns],
                     ["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if],
                     ["ip", "link", "set", node_if, "netns", ns],
                     ["ip", "addr", "add", f"{self.host_addr(i)}/30", "dev", host_if],
                     ["ip", "link", "set", host_if, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{self.node_addr(i)}/30", "dev", node_if],
                     ["ip", "-n", ns, "link", "set", node_if, "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "route", "add", "default", "via", self.host_addr(i)]):
            subprocess.run(argv, check=True, capture_output=True)

    def _del_netns(self, i: int) -> None:
        subprocess.run(["ip", "netns", "del", self.netns(i)], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.prefix}{i}h"], check=False,
                       capture_output=True)

    def redis_url(self, host: str = "127.0.0.1") -> str:
        return f"redis://:{self._redis_password}@{host}:{self.redis_port}/0"

    def _start_redis(self) -> None:
        """Redis with a password (it listens on the nodes' veths too), from a 0600 config
        file: the password is in no command line; the services get it in AENV_CLUSTER_REDIS."""
        assert self.root is not None
        data = private_dir(self.root / "redis")
        binds = ["127.0.0.1", *(self.host_addr(i) for i in range(1, self.nodes + 1))]
        conf = data / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"port {self.redis_port}\nbind {' '.join(binds)}\nsave \"\"\n"
                    f"appendonly no\ndir {data}\nrequirepass {self._redis_password}\n")
        self._spawn("redis", ["redis-server", str(conf)])
        deadline = time.monotonic() + 30
        env = {**os.environ, "REDISCLI_AUTH": self._redis_password}
        while subprocess.run(["redis-cli", "-p", str(self.redis_port), "ping"],
                             check=False, capture_output=True, env=env,
                             text=True).stdout.strip() != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis did not start: {self.log('redis')}")
            time.sleep(0.1)

    def kill_service(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop the redis, scheduler or gateway process (SIGKILL: as a crash)."""
        for proc in [p for p in self.procs if p.name == name]:
            _signal(proc, sig)
            self.procs.remove(proc)

    def restart_service(self, name: str) -> Proc:
        """Start `name` again as it was started (after `kill_service`)."""
        argv, health, redis_host = self._specs[name]
        return self._spawn(name, argv, health=health, redis_host=redis_host)

    def _spawn(self, name: str, argv: list[str], *, health: str | None = None,
               redis_host: str | None = None) -> Proc:
        assert self.root is not None
        self._specs[name] = (argv, health, redis_host)
        env = dict(os.environ)
        if redis_host is not None:
            env["AENV_CLUSTER_REDIS"] = self.redis_url(redis_host)
        log = open(self.root / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child's
        popen = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env)
        log.close()
        proc = Proc(name, popen, health)
        self.procs.append(proc)
        if health is not None:
            self._wait_health(proc)
        return proc

    def _wait_health(self, proc: Proc, timeout_s: float = 120.0) -> None:
        assert proc.health is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited {proc.popen.returncode}: "
                                   f"{self.log(proc.name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(proc.health, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{proc.name} did not answer {proc.health}: {self.log(proc.name)}")

    def _wait_nodes_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        ready: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(f"{self.gateway_url}/nodes", timeout=2,
                              headers={"X-API-Key": self.api_key})
                ready = [n["nodeID"] for n in r.json() if n.get("state") == "ready"]
                if len(ready) == self.nodes:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"only {ready} of {self.nodes} nodes became ready: "
                           f"{self.log('gateway')}")

    def log(self, name: str, n: int = 3000) -> str:
        assert self.root is not None
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    # --- stop ---------------------------------------------------------------------------

    def kill_sandboxes(self, i: int) -> None:
        """Kill every sandbox node `i` holds (through its own API)."""
        url = f"http://{self.node_addr(i)}:{NODE_API_PORT}"
        ids: list[str] = []
        with httpx.Client(base_url=url, headers={"X-API-Key": self.api_key},
                          timeout=120) as c:
            token: str | None = None
            while True:
                r = c.get("/v2/sandboxes", params={"limit": 100,
                                                   **({"nextToken": token} if token else {})})
                if r.status_code != 200:
                    break
                ids += [str(x["sandboxID"]) for x in r.json()]
                token = r.headers.get("x-next-token")
                if not token:
                    break
            for sid in ids:
                c.delete(f"/sandboxes/{sid}")

    def stop_node(self, i: int, *, sig: int = signal.SIGTERM) -> None:
        proc = self.node_procs.pop(i, None)
        if proc is not None:
            _signal(proc, sig)

    def stop(self) -> None:
        """Stop everything, each step whatever the others did."""
        for i in list(self.node_procs):
            if self.node_procs[i].popen.poll() is None:
                try:
                    self.kill_sandboxes(i)
                except Exception as exc:  # noqa: BLE001 - its VMs go with the leftovers
                    print(f"cluster: killing node{i}'s sandboxes failed: {exc!r}",
                          file=sys.stderr)
            self.stop_node(i)
        for proc in reversed(self.procs):
            _signal(proc, signal.SIGTERM)
        self.procs.clear()
        self._kill_leftovers()
        for i in range(1, self.nodes + 1):
            self._del_netns(i)
        if self._temp and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """VMMs and block servers of nodes that were SIGKILLed: they name our dirs."""
        assert self.root is not None
        marks = [str(self.root), *(f"/run/{self.prefix}-n{i}" for i in range(1, 10))]
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if any(m in cmd for m in marks):
                    os.kill(int(d.name), signal.SIGKILL)
        for i in range(1, 10):
            shutil.rmtree(f"/run/{self.prefix}-n{i}", ignore_errors=True)
        for ns in subprocess.run(["ip", "netns", "list"], check=False, capture_output=True,
                                 text=True).stdout.split("\n"):
            name = ns.split(" ")[0]
            if any(name.startswith(f"{self.prefix}{i}-") for i in range(1, 10)):
                subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _signal(proc: Proc, sig: int, timeout_s: float = 60.0) -> None:
    if proc.popen.poll() is not None:
        return
    proc.popen.send_signal(sig)  # the process only: a node's VMs are not in its group
    try:
        proc.popen.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m host.cluster.local",
                                description="Redis, scheduler, gateway and N nodes on this "
                                            "machine (`make cluster`); Ctrl+C stops them all")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--root", type=Path, help="keep state here (default: a temporary dir)")
    p.add_argument("--gateway-port", type=int, default=8080)
    p.add_argument("--scheduler-port", type=int, default=9090)
    p.add_argument("--redis-port", type=int, default=6390)
    p.add_argument("--strategy", choices=("round-robin", "least-loaded"), default="round-robin",
                   help="placement (default round-robin: the nodes share one machine)")
    args, node_args = p.parse_known_args(argv)
    cluster = LocalCluster(nodes=args.nodes, root=args.root, gateway_port=args.gateway_port,
                           scheduler_port=args.scheduler_port, redis_port=args.redis_port,
                           strategy=args.strategy, node_args=node_args)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"cluster: starting redis, scheduler, gateway and {args.nodes} nodes ...", flush=True)
    cluster.start()
    print(f"cluster: up (state and logs in {cluster.root}). Point the E2B SDKs at the "
          f"gateway:\n{cluster.exports()}\nCtrl+C stops everything.", flush=True)
    while not stop:
        time.sleep(0.5)
    print("cluster: stopping ...", flush=True)
    cluster.stop()
    print("cluster: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
