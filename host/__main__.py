"""`python -m host` (`make run`): the host service of one node.

Builds the state store, the node runtime, the orchestrator (recovery, then the TTL loop),
and serves the REST API and the sandbox proxy with two uvicorn servers in one event loop.
SIGTERM / SIGINT: stop accepting, let in-flight operations finish, close everything;
running VMs are left running and adopted at the next start, or, with --drain-on-stop
(containers: the VMs die with the service), paused first and resumed by the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import signal
import socket
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from host import heap
from host.api import ApiKeys, NodeKeys, build_api_app
from host.api.auth import check_separate
from host.config import Config, ConfigError, parse_config
from host.contract import MachineSpec
from host.metrics import Metrics, ProxyMetrics, setup_logging
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.admission import AdmissionPolicy
from host.orchestrator.pressure import PressurePolicy
from host.proxy import build_proxy_app
from host.web.links import TerminalLinks

log = logging.getLogger("host")


class _Server(uvicorn.Server):
    """uvicorn server that leaves signal handling to us (two servers share one loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


KEEP_ALIVE_S = 75  # idle client connections kept open (both listeners)


async def open_runtime(cfg: Config, metrics: Metrics | None = None) -> Any:
    """`host.runtime.NodeRuntime` for this config, opened (imported lazily)."""
    try:
        from host.runtime import NodeRuntime, RuntimeConfig
    except ImportError as exc:
        raise SystemExit(f"aenv: the node runtime (host.runtime.NodeRuntime) is not available: "
                         f"{exc}") from None
    rt = NodeRuntime(RuntimeConfig(state_dir=cfg.state_dir, run_dir=cfg.run_dir,
                                   repository=cfg.repository_spec, cache_dir=cfg.cache_dir,
                                   collect_min_age_s=cfg.gc_min_age_s,
                                   build_cache_ttl_s=cfg.build_cache_ttl_s,
                                   node_id=cfg.node_id or socket.gethostname(),
                                   cache_mib=cfg.cache_mib, memory_cache_mib=cfg.cache_mib,
                                   network=cfg.network, vmm=cfg.vmm, firecracker=cfg.firecracker,
                                   jailer=cfg.jailer, jailer_uid=cfg.jailer_uid,
                                   jailer_gid=cfg.jailer_gid,
                                   network_prefix=cfg.network_prefix,
                                   network_pool=cfg.network_pool,
                                   envd_timeout_s=cfg.envd_timeout_s, ksm=cfg.ksm, p2p=cfg.p2p,
                                   tcg_tb_mib=cfg.tcg_tb_mib,
                                   balloon=cfg.vm_balloon, builders=cfg.builders,
                                   jail=cfg.jail(),
                                   registry_mirror=cfg.registry_mirror,
                                   insecure_registries=cfg.insecure_registries),
                     metrics=metrics)
    return await rt.open()


def banner(cfg: Config) -> str:
    """What `make run` prints once it serves: where to point the SDKs. It names the key
    file, never a key: terminals, CI logs and screen shares keep what they are shown."""
    scheme = "https" if cfg.tls else "http"
    host = "127.0.0.1" if cfg.listen in ("0.0.0.0", "::") else cfg.listen
    lines = [
        (f"aenv host service: API {scheme}://{host}:{cfg.api_port}, "
         f"proxy {scheme}://{host}:{cfg.proxy_port}, state {cfg.state_dir}"),
        f"API key file: {cfg.keys_path}",
        "Point the E2B SDKs at this node with:",
        f"  export E2B_API_URL={scheme}://{host}:{cfg.api_port}",
        f"  export E2B_SANDBOX_URL={scheme}://{host}:{cfg.proxy_port}",
        f"  export E2B_API_KEY=$(head -1 {shlex.quote(str(cfg.keys_path))})",
        f"  export E2B_VOLUME_API_URL={scheme}://{host}:{cfg.api_port}   # volumes' files",
    ]
    if cfg.tls:
        lines += [
            f"  # or, with *.{cfg.domain} resolving here and the proxy on :443:",
            f"  export E2B_DOMAIN={cfg.domain}",
        ]
    if cfg.tls and cfg.tls_cert is None:   # an operator's certificate has its own CA
        lines.append(f"  # trust the CA: export SSL_CERT_FILE={cfg.tls_dir / 'ca.pem'} "
                     f"NODE_EXTRA_CA_CERTS={cfg.tls_dir / 'ca.pem'}")
    return "\n".join(lines)


async def serve(cfg: Config) -> None:
    store = Store(cfg.db_path)
    runtime = None
    orch = None
    member = None  # this node in a cluster (--cluster-redis): its heartbeat into Redis
    metrics = Metrics()  # this service's registry: runtime, orchestrator, API, proxy
    try:
        runtime = await open_runtime(cfg, metrics)
        orch = NodeOrchestrator(
            store, runtime, domain=cfg.domain, default_template=cfg.default_template,
            machine=MachineSpec(cpu_count=cfg.cpu_count, memory_mb=cfg.memory_mb,
                                disk_mb=cfg.disk_mb, image=cfg.image),
            admission=AdmissionPolicy(max_starts=cfg.max_starts,
                                      max_sandboxes=cfg.max_sandboxes,
                                      reserve_mib=cfg.memory_reserve_mib,
                                      disk_path=cfg.state_dir,
                                      min_free_disk_mib=cfg.min_free_disk_mib),
            pressure=(PressurePolicy(low_mib=cfg.memory_pressure_mib,
                                     high_mib=2 * cfg.memory_pressure_mib)
                      if cfg.memory_pressure_mib else None),
            # in a cluster, pauses leave handoffs so another node can take a sandbox over
            metrics=metrics, handoff=bool(cfg.cluster_redis), warm_pool=cfg.warm_pool,
            keep_paused_s=cfg.keep_paused_s, gc_interval_s=cfg.gc_interval_s,
            retain_killed_s=cfg.retain_killed_s, build_cache_ttl_s=cfg.build_cache_ttl_s,
            volumes_dir=cfg.volumes_dir)
        # in a cluster, drained sandboxes resume after the first heartbeat (node.py)
        await orch.start(ttl_interval_s=cfg.ttl_interval_s,
                         resume_drained=not cfg.cluster_redis)
        keys = ApiKeys.load_or_create(cfg.keys_path)
        extra_routes: list[Any] = []
        node_keys = None   # in a cluster: what the gateway, scheduler and neighbours send
        if cfg.cluster_redis:
            from host.cluster.node import ClusterMember
            from host.cluster.peers import layers_route, memory_route
            try:
                node_keys = NodeKeys.load_or_create(cfg.node_key_path)
                check_separate(keys, node_keys)
            except ValueError as exc:
                raise SystemExit(f"aenv: {exc}") from None
            member = ClusterMember.from_config(cfg, orch, node_key=node_keys.first)
            member.start()
            if member.peers is not None:   # --p2p: neighbours send each other the node key
                await runtime.use_peers(member.peers)
                member.peers.serve_layers(runtime.held_layers, runtime.peers_file)
                extra_routes += [memory_route(runtime.memory_file),
                                 layers_route(runtime.layer_range)]
        links = TerminalLinks.load_or_create(cfg.state_dir)
        api = build_api_app(orch, keys, domain=cfg.domain, state_dir=cfg.state_dir,
                            max_upload_bytes=cfg.template_upload_mib << 20,
                            terminal_links=links, terminal_base_url=cfg.public_proxy_url,
                            metrics=metrics if cfg.metrics else None,
                            extra_routes=extra_routes, node_keys=node_keys)
        proxy = build_proxy_app(orch, cfg.domain, api_app=api if cfg.tls else None,
                                terminal_links=links, keys=keys)
        # counted from outside the proxy app (host/metrics/asgi.py); not the API it serves
        proxy_listener = (ProxyMetrics(proxy, metrics,
                                       skip_hosts=frozenset({f"api.{cfg.domain}"}))
                          if cfg.metrics else proxy)
        # json logs: uvicorn's loggers reach the root's JSON handler instead of their own
        logs: dict[str, Any] = {"log_config": None} if cfg.log_format == "json" else {}
        ssl: dict[str, Any] = {}
        if cfg.tls_cert is not None and cfg.tls_key is not None:
            ssl = {"ssl_certfile": str(cfg.tls_cert), "ssl_keyfile": str(cfg.tls_key)}
        elif cfg.tls:
            from host.proxy.tls import ensure_certificates
            paths = ensure_certificates(cfg.tls_dir, cfg.domain)
            ssl = {"ssl_certfile": str(paths.cert), "ssl_keyfile": str(paths.key)}
        servers = [
            # keep-alive well past uvicorn's 5 s: the SDKs pool connections and retry a
            # 429 after its Retry-After (5 s), which otherwise races the server's close
            _Server(uvicorn.Config(api, host=cfg.listen, port=cfg.api_port, lifespan="off",
                                   log_level=cfg.log_level, timeout_graceful_shutdown=10,
                                   timeout_keep_alive=KEEP_ALIVE_S, **ssl, **logs)),
            _Server(uvicorn.Config(proxy_listener, host=cfg.listen, port=cfg.proxy_port,
                                   lifespan="on", log_level=cfg.log_level,
                                   timeout_graceful_shutdown=10,
                                   timeout_keep_alive=KEEP_ALIVE_S, **ssl, **logs)),
        ]
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(s.serve(), name=f"uvicorn:{s.config.port}")
                     for s in servers]
            for s in servers:
                while not s.started and not any(t.done() for t in tasks):
                    await asyncio.sleep(0.05)
            if all(s.started for s in servers):
                print(banner(cfg), flush=True)
            waiter = tg.create_task(stop.wait())
            await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            log.info("shutting down")
            if stop.is_set() and cfg.drain_on_stop:
                # the VMs die with this process (a container): pause them first, while the
                # API still answers (starts refused, /health draining; drain.py); in a
                # cluster, heartbeats before and after it (Heartbeat.now)
                if member is not None:
                    await member.heartbeat.now(draining=True)
                await orch.drain()
                if member is not None:
                    await member.heartbeat.now()
            for s in servers:
                s.should_exit = True
            waiter.cancel()
        if not stop.is_set():
            raise SystemExit("aenv: a listener stopped unexpectedly (port in use?)")
    finally:
        if member is not None:
            await member.aclose()
        if orch is not None:
            await orch.aclose()
        if runtime is not None:
            await runtime.aclose()
        store.close()


def main(argv: Sequence[str] | None = None) -> int:
    heap.configure()  # before any thread (host/heap.py)
    try:
        cfg = parse_config(argv)
    except ConfigError as exc:
        print(f"aenv: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format)
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
