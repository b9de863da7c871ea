"""A whole cluster in this process, on loopback ports: a private redis-server, the
scheduler and the gateway (uvicorn threads), and nodes, each a thread with its own event
loop running what `python -m host` runs (a real `NodeOrchestrator` over the fake runtime,
the REST API, the sandbox proxy, the cluster heartbeat) plus an echo server that stands
for every sandbox's user port 8000 on that node. envd's port 49983 of every sandbox is
one real envd process (tests/proxy's), so the SDKs' commands and files work end to end.
Clients use API_KEY; the gateway and the scheduler call into nodes with NODE_KEY, a key
of its own as in production. With `tls` (certificates of host/proxy/tls.py's local CA),
the nodes serve their API and proxy over HTTPS and the gateway verifies them with that CA.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import redis
import uvicorn
from starlette.types import Receive, Scope, Send

from host.api import ApiKeys, NodeKeys, build_api_app
from host.cluster.config import GatewayConfig, SchedulerConfig
from host.cluster.gateway import build_gateway
from host.cluster.heartbeat import Heartbeat
from host.cluster.node import Machine, orchestrator_report
from host.cluster.placement import Strategy
from host.cluster.registry import Registry
from host.cluster.scheduler import build_scheduler_app
from host.cluster.store import ClusterStore
from host.contract import Placement
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.admission import AdmissionPolicy
from host.orchestrator.envd import EnvdClient
from host.proxy import build_proxy_app
from host.proxy.tls import CertPaths
from tests.api.conftest import API_KEY, free_port
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

DOMAIN = "sbx.test"
NODE_KEY = "aenv_node_test_key"   # what the gateway and the scheduler send to nodes
USER_PORT = 8000          # every sandbox's "user service": its node's echo server
HEARTBEAT_S = 0.5
MISSES = 4                # dead 2 s after the last heartbeat (loaded 2-core CI hosts)
SWEEP_S = 0.2


def listen_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound on loopback (`port` 0: any free one), held from now on, so that
    no other socket takes the port before the server listens (free_port()'s race: the
    tests make thousands of outgoing connections, whose ports come from the same range).
    A given port is retried for a while (its previous server is closing)."""
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Served:
    """A uvicorn server in a thread on a socket bound beforehand (tests/api's
    ServerThread, without the port race); stopped, joined and its socket closed on exit."""

    def __init__(self, app: Any, port: int = 0, **kwargs: Any) -> None:
        self.sock = listen_socket(port)
        self.port = int(self.sock.getsockname()[1])
        kwargs.setdefault("lifespan", "off")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **kwargs))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.sock.close()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class OpenEnvd(FakeEnvd):
    """FakeEnvd without its per-host token rule: every fake sandbox here is at 127.0.0.1."""

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.tokens.clear()
        return super().handler(request)


class LoopbackRuntime(FakeRuntime):
    """FakeRuntime whose VMs' ports are forwarded to loopback servers: envd's port to
    the real envd, USER_PORT to the node's echo server."""

    def __init__(self, ports: dict[int, int]) -> None:
        super().__init__()
        self.ports = {str(k): v for k, v in ports.items()}

    async def start(self, sandbox_id: str, snapshot: Any, network: Any, *,
                    reboot: bool = False, **kwargs: Any) -> Placement:
        p = await super().start(sandbox_id, snapshot, network, reboot=reboot, **kwargs)
        here = Placement(sandbox_id, "127.0.0.1", p.envd_port,
                         {**p.facts, "port_forwards": self.ports})
        self.vms[sandbox_id] = here
        return here


def echo_app(node_id: str):
    """HTTP: JSON {node, path, host, sandbox, body}; WebSocket: echoes "<node>:<msg>"."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            while True:
                msg = await receive()
                if msg["type"] == "websocket.disconnect":
                    return
                await send({"type": "websocket.send", "text": f"{node_id}:{msg.get('text')}"})
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        out = json.dumps({"node": node_id, "path": scope["path"], "host": headers.get("host"),
                          "sandbox": headers.get("e2b-sandbox-id"),
                          "body": body.decode()}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})

    return app


@dataclass
class SharedRepository:
    """What the nodes' repository holds, as the fake runtimes see it: snapshots and
    handoff documents (one object for every node of a cluster, as one shared directory)."""

    snapshots: dict[str, Any] = field(default_factory=dict)
    documents: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def handoffs(self) -> dict[str, dict[str, Any]]:
        return {k.removeprefix("handoff-"): v for k, v in self.documents.items()
                if k.startswith("handoff-")}


class ClusterNode:
    """One node in its own thread and loop; `start()` / `stop()` (heartbeat cancelled,
    servers stopped, orchestrator closed: as a node process that ends)."""

    def __init__(self, node_id: str, state_dir: Path, redis_url: str, envd_port: int, *,
                 max_sandboxes: int = 0, repository: SharedRepository | None = None,
                 tls: CertPaths | None = None) -> None:
        self.node_id = node_id
        self.tls = tls
        self.repository = repository or SharedRepository()
        self.state_dir = state_dir
        self.redis_url = redis_url
        self.envd_port = envd_port
        self.max_sandboxes = max_sandboxes
        self._sockets = [listen_socket() for _ in range(3)]   # api, proxy, echo
        self.api_port, self.proxy_port, self.echo_port = (
            int(sock.getsockname()[1]) for sock in self._sockets)
        self.heartbeat: Heartbeat | None = None
        self.orch: NodeOrchestrator | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.api_port}"

    @property
    def proxy_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.proxy_port}"

    def start(self) -> None:
        self._ready.clear()
        if not self._sockets:   # restarted: the same ports again
            self._sockets = [listen_socket(p) for p in (self.api_port, self.proxy_port,
                                                        self.echo_port)]
        self._thread = threading.Thread(target=self._thread_main, daemon=True,
                                        name=f"node-{self.node_id}")
        self._thread.start()
        if not self._ready.wait(20) or self._error is not None:
            raise RuntimeError(f"node {self.node_id} did not start: {self._error!r}")

    def stop(self) -> None:
        """Stop the node (its listening sockets are closed: connecting is refused)."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive() and self._loop is not None \
                and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            thread.join(30)
        for sock in self._sockets:
            sock.close()
        self._sockets = []

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the node's loop (e.g. an orchestrator call)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        store = Store(self.state_dir / "state.db")
        runtime = LoopbackRuntime({49983: self.envd_port, USER_PORT: self.echo_port})
        runtime.snapshots = self.repository.snapshots   # the nodes share one repository
        runtime.documents = self.repository.documents
        orch = self.orch = NodeOrchestrator(
            store, runtime, domain=DOMAIN, envd=EnvdClient(transport=OpenEnvd().transport()),
            admission=AdmissionPolicy(max_sandboxes=self.max_sandboxes, reserve_mib=0),
            handoff=True)
        await orch.start(ttl_interval_s=3600, resume_drained=False)   # as host/__main__.py
        api = build_api_app(orch, ApiKeys([API_KEY]), domain=DOMAIN,
                            node_keys=NodeKeys([NODE_KEY]))
        proxy = build_proxy_app(orch, DOMAIN)
        tls: dict[str, Any] = ({"ssl_certfile": str(self.tls.cert),
                                "ssl_keyfile": str(self.tls.key)} if self.tls else {})
        servers = [uvicorn.Server(uvicorn.Config(app, lifespan=lifespan, log_level="warning",
                                                 **extra))
                   for app, lifespan, extra in ((api, "off", tls), (proxy, "on", tls),
                                                (echo_app(self.node_id), "on", {}))]
        tasks = [asyncio.create_task(s.serve(sockets=[sock]))
                 for s, sock in zip(servers, self._sockets, strict=True)]
        cstore = ClusterStore.from_url(self.redis_url)
        try:
            while not all(s.started for s in servers):
                if any(t.done() for t in tasks):
                    raise RuntimeError("a node listener stopped")
                await asyncio.sleep(0.02)
            self.heartbeat = Heartbeat(
                Registry(cstore), node_id=self.node_id, address=self.url,
                proxy_address=self.proxy_url,
                report=orchestrator_report(orch, max_sandboxes=self.max_sandboxes,
                                           machine=fixed_machine),
                interval_s=HEARTBEAT_S, misses=MISSES, disown=orch.forget,
                joined=orch.resume_drained)
            self.heartbeat.start()
            self._ready.set()
            await self._stop.wait()
        finally:
            if self.heartbeat is not None:
                await self.heartbeat.aclose()
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            await orch.aclose(grace_s=5)
            await cstore.aclose()
            store.close()


def fixed_machine() -> Machine:
    """Every test node reports the same machine (they share this host's memory)."""
    return Machine(cpu_count=2, memory_mib=16384, available_mib=12288, load=0.1)


_prctl = ctypes.CDLL(None, use_errno=True).prctl   # resolved here, not in the child


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (Linux)."""
    _prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class RedisServer:
    """A private redis-server on a loopback port, no persistence, in a temp dir; with
    `password`, clients must AUTH (requirepass, from a 0600 config file as deploy/ does);
    with `tls`, it speaks TLS only, with that certificate."""

    def __init__(self, *, password: str | None = None, tls: CertPaths | None = None) -> None:
        self.password = password
        self.tls = tls
        self.dir = Path(tempfile.mkdtemp(prefix="aenv-redis-"))
        for attempt in range(3):   # free_port() may be taken before redis binds it
            try:
                self._start()
                return
            except RuntimeError:
                if attempt == 2:
                    shutil.rmtree(self.dir, ignore_errors=True)
                    raise

    def _start(self) -> None:
        self.port = free_port()
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        conf = self.dir / "redis.conf"   # the password in a file, not on the command line
        conf.write_text(f"requirepass {self.password}\n" if self.password else "")
        conf.chmod(0o600)
        port = ["--port", str(self.port)]
        if self.tls is not None:
            port = ["--port", "0", "--tls-port", str(self.port),
                    "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                    "--tls-ca-cert-file", str(self.tls.ca_cert), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(
            [exe, str(conf), *port, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call, nothing to lock
        deadline = time.monotonic() + 10
        client = redis.Redis.from_url(self.url)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self._kill()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca_cert}"

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Cluster:
    """Redis (given), the scheduler, the gateway and `n` nodes; `close()` stops them."""

    def __init__(self, redis_url: str, root: Path, envd_port: int, *, nodes: int = 3,
                 max_sandboxes: int = 0, strategy: Strategy = Strategy.LEAST_LOADED,
                 tls: CertPaths | None = None) -> None:
        self.redis_url = redis_url
        self.root = root
        self.strategy = strategy
        self.tls = tls
        self.scheduler_port = self.gateway_port = 0   # known once started
        self.scheduler: Served | None = None
        self.gateway: Served | None = None
        self.repository = SharedRepository()
        self.nodes = [ClusterNode(f"node{i}", root / f"node{i}", redis_url, envd_port,
                                  max_sandboxes=max_sandboxes, repository=self.repository,
                                  tls=tls)
                      for i in range(1, nodes + 1)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self) -> Cluster:
        self.start_scheduler()
        self.start_gateway()
        for node in self.nodes:
            node.start()
        return self

    def start_scheduler(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        node_key = self.root / "node_key"
        node_key.write_text(NODE_KEY + "\n")
        cfg = SchedulerConfig(redis=self.redis_url, strategy=self.strategy, sweep_s=SWEEP_S,
                              node_key_file=node_key)
        self.scheduler = Served(build_scheduler_app(cfg), port=self.scheduler_port,
                                lifespan="on").__enter__()
        self.scheduler_port = self.scheduler.port

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.__exit__(None, None, None)
            self.scheduler = None

    def start_gateway(self) -> None:
        cfg = GatewayConfig(redis=self.redis_url,
                            scheduler=f"http://127.0.0.1:{self.scheduler_port}",
                            node_tls_ca=self.tls.ca_cert if self.tls else None)
        app = build_gateway(cfg, keys=ApiKeys([API_KEY]), node_keys=NodeKeys([NODE_KEY]))
        self.gateway = Served(app, port=self.gateway_port, lifespan="on",
                              timeout_keep_alive=75).__enter__()
        self.gateway_port = self.gateway.port

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.__exit__(None, None, None)
            self.gateway = None

    def node(self, node_id: str) -> ClusterNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        self.stop_gateway()
        self.stop_scheduler()
