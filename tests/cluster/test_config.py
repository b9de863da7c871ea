"""Configuration and entry points: the gateway's and the scheduler's settings (flags over
environment), the node's cluster settings in host/config.py, what a node advertises, the
node-side `ClusterMember` over a real orchestrator, and `python -m host.cluster.gateway`
/ `python -m host.cluster.scheduler` as real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from host.cluster.config import ConfigError, parse_gateway, parse_scheduler, split_listen
from host.cluster.node import ClusterMember, advertised_urls, read_machine
from host.cluster.placement import Strategy
from host.cluster.registry import Registry
from host.cluster.store import ClusterStore
from host.config import ConfigError as HostConfigError
from host.config import parse_config
from host.orchestrator import NodeOrchestrator, Store
from tests.api.conftest import free_port
from tests.orchestrator.fakes import FakeRuntime
from tests.proxy.conftest import start_process, stop_process


def test_gateway_and_scheduler_config() -> None:
    env = {"AENV_CLUSTER_REDIS": "redis://r:6379/1", "AENV_GATEWAY_LISTEN": "0.0.0.0:81",
           "AENV_SCHEDULER_STRATEGY": "round-robin"}
    g = parse_gateway(["--scheduler", "http://s:9", "--node-key-file", "/k"], env)
    assert (g.redis, g.address, g.scheduler, g.node_key_file) == (
        "redis://r:6379/1", ("0.0.0.0", 81), "http://s:9", Path("/k"))
    assert g.node_tls_ca is None
    assert parse_gateway([], {}).node_key_file == Path("/var/lib/aenv/node_key")
    s = parse_scheduler(["--listen", "[::1]:95", "--sandbox-mib", "512"], env)
    assert s.strategy is Strategy.ROUND_ROBIN and s.address == ("::1", 95)
    assert s.sandbox_mib == 512 and s.node_key_file is None
    assert parse_scheduler([], {"AENV_NODE_KEY_FILE": "/nk"}).node_key_file == Path("/nk")
    assert parse_scheduler(["--strategy", "least-loaded"], env).strategy is Strategy.LEAST_LOADED
    assert split_listen("10.0.0.1", 8080) == ("10.0.0.1", 8080)
    for bad in (["--redis", "http://x"], ["--listen", "a:0"], ["--sandbox-mib", "0"]):
        with pytest.raises(ConfigError):
            parse_scheduler(bad, {})
    with pytest.raises(ConfigError):
        parse_gateway(["--scheduler", "ftp://x"], {})
    with pytest.raises(ConfigError):
        parse_scheduler([], {"AENV_SCHEDULER_SANDBOX_MIB": "lots"})
    with pytest.raises(ConfigError, match="does not exist"):
        parse_gateway(["--node-tls-ca", "/nope/ca.pem"], {})
    # a Redis URL's password stays out of the messages
    with pytest.raises(ConfigError) as refused:
        parse_gateway(["--redis", "http://:s3cret@r:6379/0"], {})
    assert "s3cret" not in str(refused.value) and "***" in str(refused.value)


def test_node_cluster_config_and_advertised_urls() -> None:
    cfg = parse_config(["--cluster-redis", "redis://r/0", "--node-id", "n-1",
                        "--heartbeat-interval", "1.5"], {})
    assert (cfg.cluster_redis, cfg.node_id, cfg.heartbeat_s, cfg.heartbeat_misses) == (
        "redis://r/0", "n-1", 1.5, 3)
    assert advertised_urls(cfg) == ("http://127.0.0.1:3000", "http://127.0.0.1:3001")
    cfg = parse_config([], {"AENV_CLUSTER_REDIS": "redis://r/0",
                            "AENV_ADVERTISE_URL": "http://10.1.2.3:3000/",
                            "AENV_PROXY_PORT": "4001"})
    assert advertised_urls(cfg) == ("http://10.1.2.3:3000", "http://10.1.2.3:4001")
    assert not cfg.p2p
    assert parse_config(["--cluster-redis", "redis://r/0", "--p2p"], {}).p2p
    assert parse_config([], {"AENV_CLUSTER_REDIS": "redis://r/0", "AENV_P2P": "1"}).p2p
    for bad in (["--cluster-redis", "http://x"], ["--node-id", "a:b"], ["--p2p"],
                ["--heartbeat-misses", "1"], ["--advertise-url", "10.0.0.1"]):
        with pytest.raises(HostConfigError):
            parse_config(bad, {})
    m = read_machine()
    assert m.cpu_count >= 1 and m.memory_mib >= m.available_mib > 0


def test_node_key_and_tls_settings(tmp_path: Path) -> None:
    """The node key lives in the state dir unless moved; --tls-cert/--tls-key serve the
    operator's certificate (and make the advertised URLs https://)."""
    cfg = parse_config(["--state-dir", str(tmp_path)], {})
    assert cfg.node_key_path == tmp_path / "node_key" and not cfg.tls
    assert parse_config([], {"AENV_NODE_KEY_FILE": "/etc/aenv/node_key"}).node_key_path == \
        Path("/etc/aenv/node_key")
    cert, key = tmp_path / "node.pem", tmp_path / "node-key.pem"
    cert.write_text("x")
    key.write_text("x")
    cfg = parse_config(["--tls-cert", str(cert), "--tls-key", str(key),
                        "--cluster-redis", "redis://r/0",
                        "--advertise-url", "https://node-a.internal:3000"], {})
    assert cfg.tls and (cfg.tls_cert, cfg.tls_key) == (cert, key)
    assert advertised_urls(cfg) == ("https://node-a.internal:3000",
                                    "https://node-a.internal:3001")
    assert parse_config([], {"AENV_TLS_CERT": str(cert), "AENV_TLS_KEY": str(key)}).tls
    for bad, message in ((["--tls-cert", str(cert)], "go together"),
                         (["--tls-cert", str(cert), "--tls-key", str(key), "--no-tls"],
                          "contradicts"),
                         (["--tls-cert", "/nope", "--tls-key", str(key)], "does not exist")):
        with pytest.raises(HostConfigError, match=message):
            parse_config(bad, {})
    with pytest.raises(HostConfigError) as exc:
        parse_config(["--cluster-redis", "http://:s3cret@r/0"], {})
    assert "s3cret" not in str(exc.value)


@pytest.mark.asyncio(loop_scope="function")
async def test_cluster_member_heartbeats_a_node(redis_url: str, tmp_path: Path) -> None:
    cfg = parse_config(["--cluster-redis", redis_url, "--node-id", "solo",
                        "--heartbeat-interval", "0.1", "--max-sandboxes", "7",
                        "--api-port", "3555"], {})
    store = Store(tmp_path / "state.db")
    orch = NodeOrchestrator(store, FakeRuntime())
    member = ClusterMember.from_config(cfg, orch)
    reader = ClusterStore.from_url(redis_url)
    try:
        member.start()
        for _ in range(50):
            node = await Registry(reader).node("solo")
            if node is not None:
                break
            await asyncio.sleep(0.05)
        assert node is not None and node.address == "http://127.0.0.1:3555"
        assert node.max_sandboxes == 7 and node.cpu_count >= 1 and node.alive
    finally:
        await member.aclose()
        await reader.aclose()
        store.close()


def test_entry_points_serve(redis_url: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("e2b_cli_key\n")
    node_key = tmp_path / "node_key"
    node_key.write_text("aenv_node_cli_key\n")
    sched_port, gw_port = free_port(), free_port()
    sched = start_process([sys.executable, "-m", "host.cluster.scheduler", "--redis",
                           redis_url, "--listen", f"127.0.0.1:{sched_port}",
                           "--node-key-file", str(node_key)],
                          health=f"http://127.0.0.1:{sched_port}/health")
    try:
        gw = start_process([sys.executable, "-m", "host.cluster.gateway", "--redis", redis_url,
                            "--listen", f"127.0.0.1:{gw_port}", "--keys", str(keys),
                            "--node-key-file", str(node_key),
                            "--scheduler", f"http://127.0.0.1:{sched_port}"],
                           health=f"http://127.0.0.1:{gw_port}/health")
        try:
            url = f"http://127.0.0.1:{gw_port}"
            assert httpx.get(f"{url}/nodes", headers={"X-API-Key": "e2b_cli_key"}).json() == []
            r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base"},
                           headers={"X-API-Key": "e2b_cli_key"})
            assert r.status_code == 429 and "no node is registered" in r.json()["message"]
        finally:
            stop_process(gw)
    finally:
        stop_process(sched)
    bad = subprocess.run([sys.executable, "-m", "host.cluster.gateway", "--redis", "http://nope"],
                         check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and "--redis" in bad.stderr
    # no node key file: both refuse to start (a new key there would be one no node accepts)
    for service, args in (("gateway", ["--keys", str(keys)]), ("scheduler", [])):
        bad = subprocess.run([sys.executable, "-m", f"host.cluster.{service}", *args,
                              "--node-key-file", str(tmp_path / "absent")],
                             check=False, capture_output=True, text=True)
        assert bad.returncode == 2 and "no node key file" in bad.stderr, bad.stderr
    # the node key one of the clients' keys: the gateway refuses it
    keys.write_text("e2b_cli_key\naenv_node_cli_key\n")
    bad = subprocess.run([sys.executable, "-m", "host.cluster.gateway", "--keys", str(keys),
                          "--node-key-file", str(node_key)],
                         check=False, capture_output=True, text=True)
    assert bad.returncode == 2 and "also an API key" in bad.stderr, bad.stderr


def test_gateway_serves_https(redis_url: str, tmp_path: Path) -> None:
    """--tls-cert/--tls-key: the gateway speaks HTTPS only (the certificate here is one
    host/proxy/tls.py issues from its local CA for 127.0.0.1)."""
    from host.proxy.tls import ensure_certificates

    paths = ensure_certificates(tmp_path / "tls", "gw.test")
    keys = tmp_path / "keys"
    keys.write_text("e2b_cli_key\n")
    node_key = tmp_path / "node_key"
    node_key.write_text("aenv_node_cli_key\n")
    port = free_port()
    gw = start_process([sys.executable, "-m", "host.cluster.gateway", "--redis", redis_url,
                        "--listen", f"127.0.0.1:{port}", "--keys", str(keys),
                        "--node-key-file", str(node_key),
                        "--tls-cert", str(paths.cert), "--tls-key", str(paths.key)])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=str(paths.ca_cert))
                break
            except httpx.TransportError:
                assert gw.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        with pytest.raises(httpx.TransportError):   # not plain HTTP
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):     # nor an untrusted certificate
            httpx.get(f"https://127.0.0.1:{port}/health")
    finally:
        stop_process(gw)
    for args, message in ((["--tls-cert", str(paths.cert)], "go together"),
                          (["--tls-cert", "/nope", "--tls-key", "/nope"], "does not exist")):
        bad = subprocess.run([sys.executable, "-m", "host.cluster.gateway", *args],
                             check=False, capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
