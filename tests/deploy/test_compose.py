"""deploy/compose: the cluster simulation's file under `docker-compose config` (validation
without a daemon), and its wiring read from the resolved configuration: five services and
their start order, the shared repository in both nodes, each node's own state, the gateway
published on :8080, the cluster settings pointing at the right services, Redis requiring the
password every client's URL carries, and the node key its own secret. Running it needs a
Docker daemon (and KVM for useful speed): `test_gateway_comes_up` runs only where there is one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from .redis_script import fails, redis_cli, run_script

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose" / "docker-compose.yml"
NODES = ("node-a", "node-b")
CLIENTS = ("scheduler", "gateway", *NODES)   # of Redis
# what deploy/compose/.env holds in a real deployment
PASSWORD = "test-redis-password"
ENV = {**os.environ, "AENV_REDIS_PASSWORD": PASSWORD}


def _compose_cmd() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True, check=False,
                                                 timeout=30).returncode == 0:
        return ["docker", "compose"]
    return None


COMPOSE_CMD = _compose_cmd()
needs_compose = pytest.mark.skipif(COMPOSE_CMD is None,
                                   reason="docker-compose is missing (apt-get install "
                                          "docker-compose)")


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The configuration as compose resolves it (anchors merged, paths absolute), or the
    file itself read by PyYAML where no compose is installed."""
    if COMPOSE_CMD is None:   # ${VAR:?message} as compose interpolates it
        text = re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: ENV[m.group(1)], COMPOSE.read_text())
        return dict(yaml.safe_load(text.replace("$$", "$")))
    out = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, timeout=120, check=True, env=ENV).stdout
    return dict(yaml.safe_load(out))


@needs_compose
def test_compose_config_is_valid() -> None:
    assert COMPOSE_CMD is not None
    p = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                       text=True, timeout=120, check=False, env=ENV)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


@needs_compose
def test_compose_config_catches_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("privileged: true", "privileged: maybe", 1))
    assert COMPOSE_CMD is not None
    p = subprocess.run([*COMPOSE_CMD, "-f", str(broken), "config", "-q"], capture_output=True,
                       text=True, timeout=120, check=False, env=ENV)
    assert p.returncode != 0


@needs_compose
def test_compose_refuses_to_start_without_the_redis_password() -> None:
    """No AENV_REDIS_PASSWORD (deploy/compose/.env): compose refuses the file, rather than
    run a Redis anyone on the network could write the cluster's index into."""
    assert COMPOSE_CMD is not None
    env = {k: v for k, v in ENV.items() if k != "AENV_REDIS_PASSWORD"}
    p = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                       text=True, timeout=120, check=False, env=env)
    assert p.returncode != 0 and "AENV_REDIS_PASSWORD" in p.stderr, p.stderr


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    dep = svc.get("depends_on", {})
    if isinstance(dep, list):
        return {d: "service_started" for d in dep}
    return {k: v.get("condition", "service_started") for k, v in dep.items()}


def _volumes(svc: dict[str, Any]) -> dict[str, str]:
    """{container path: volume name}."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        return dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def test_the_five_services_and_their_start_order(config: dict[str, Any]) -> None:
    services = config["services"]
    assert {"redis", "scheduler", "gateway", *NODES} <= services.keys()
    assert _depends(services["scheduler"])["redis"] == "service_healthy"
    assert _depends(services["gateway"]) == {"redis": "service_healthy",
                                             "scheduler": "service_healthy"}
    for node in NODES:
        dep = _depends(services[node])
        assert dep["redis"] == "service_healthy"
        assert dep["keys"] == dep["guest-build"] == "service_completed_successfully"
    for svc in ("redis", "scheduler", "gateway"):
        assert "healthcheck" in services[svc]


def test_nodes_share_the_repository_and_keep_their_own_state(config: dict[str, Any]) -> None:
    services = config["services"]
    vols = {n: _volumes(services[n]) for n in NODES}
    envs = {n: _env(services[n]) for n in NODES}
    repo_path = envs["node-a"]["AENV_REPOSITORY"].removeprefix("posix_fs:")
    assert all(e["AENV_REPOSITORY"] == f"posix_fs:{repo_path}" for e in envs.values())
    assert vols["node-a"][repo_path] == vols["node-b"][repo_path] == "repository"
    assert vols["node-a"]["/var/lib/aenv"] == "node-a-state"
    assert vols["node-b"]["/var/lib/aenv"] == "node-b-state"
    assert {"repository", "node-a-state", "node-b-state"} <= config["volumes"].keys()
    # the keys service gives each node's state the cluster's key file
    keys = _volumes(services["keys"])
    assert {keys["/state/node-a"], keys["/state/node-b"]} == {"node-a-state", "node-b-state"}


def test_nodes_run_privileged_with_kvm(config: dict[str, Any]) -> None:
    for node in NODES:
        svc = config["services"][node]
        assert svc["privileged"] is True
        assert "/dev/kvm:/dev/kvm" in [d if isinstance(d, str) else
                                       f"{d['source']}:{d['target']}" for d in svc["devices"]]
        assert svc["build"]["target"] == "node"
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile.node"
        # the image drains at SIGTERM (AENV_DRAIN_ON_STOP): docker waits for it
        assert svc["stop_grace_period"] in ("5m", "5m0s", 300, "300s")


def _published(svc: dict[str, Any]) -> set[tuple[int, int]]:
    """{(host port, container port)}, from the short ("8080:8080") or the long form."""
    out = set()
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            out.add((int(p["published"]), int(p["target"])))
        else:
            published, target = str(p).split(":")[-2:]
            out.add((int(published), int(target)))
    return out


def test_gateway_is_the_one_published_endpoint(config: dict[str, Any]) -> None:
    services = config["services"]
    assert _published(services["gateway"]) == {(8080, 8080)}
    assert not [s for s, svc in services.items() if s != "gateway" and svc.get("ports")]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_cluster_settings_point_at_the_services(config: dict[str, Any]) -> None:
    services = config["services"]
    redis_urls = {_env(services[s])["AENV_CLUSTER_REDIS"] for s in CLIENTS}
    assert {urlsplit(u).netloc.rpartition("@")[2] for u in redis_urls} == {"redis:6379"}
    sched_listen = _flag(services["scheduler"]["command"], "--listen")
    assert _env(services["gateway"])["AENV_SCHEDULER_URL"] == \
        f"http://scheduler:{sched_listen.rsplit(':', 1)[1]}"
    assert _flag(services["gateway"]["command"], "--listen") == "0.0.0.0:8080"
    for node in NODES:
        env = _env(services[node])
        assert env["AENV_NODE_ID"] == node
        assert env["AENV_ADVERTISE_URL"] == f"http://{node}:3000"
    for svc, variables in (("scheduler", ["AENV_NODE_KEY_FILE"]),
                           ("gateway", ["AENV_GATEWAY_KEYS", "AENV_NODE_KEY_FILE"])):
        for var in variables:
            keys = _env(services[svc])[var]
            assert _volumes(services[svc])[str(Path(keys).parent)] == "keys"
    assert "AENV_GATEWAY_KEYS" not in _env(services["scheduler"])   # clients' keys: gateway only


def test_redis_requires_the_password_every_client_sends(config: dict[str, Any]) -> None:
    services = config["services"]
    redis = services["redis"]
    assert _env(redis)["REDISCLI_AUTH"] == PASSWORD
    script = "\n".join(redis["command"]).replace("$$", "$")
    assert "requirepass" in script and "$REDISCLI_AUTH" in script
    assert PASSWORD not in script   # not on redis-server's command line
    assert "exec redis-server /tmp/redis.conf" in script and "/tmp" in redis["tmpfs"]
    assert "PONG" in " ".join(redis["healthcheck"]["test"])   # NOAUTH also exits 0
    for svc in CLIENTS:
        assert urlsplit(_env(services[svc])["AENV_CLUSTER_REDIS"]).password == PASSWORD, svc


def test_redis_script_requires_the_password(config: dict[str, Any], tmp_path: Path) -> None:
    """The redis service's script run here with redis-server: the password lands in a 0600
    file, clients without it get NOAUTH, the health check passes with it only."""
    redis = config["services"]["redis"]
    script = "\n".join(redis["command"]).replace("$$", "$")
    health = redis["healthcheck"]["test"][1]
    with run_script(script, tmp_path, {"REDISCLI_AUTH": PASSWORD}) as port:
        assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
        assert redis_cli(port, PASSWORD, health).returncode == 0
        assert redis_cli(port, "wrong", health).returncode != 0
        assert redis_cli(port, None, health).returncode != 0
    assert "no Redis password" in fails(script, {"REDISCLI_AUTH": ""})


def test_node_key_is_its_own_secret(config: dict[str, Any]) -> None:
    """`keys` makes a node key apart from the API keys and gives each node a copy, where
    the node reads it (<state>/node_key)."""
    # compose 1.29's `config` keeps the escaped `$$` of the file
    script = "\n".join(config["services"]["keys"]["command"]).replace("$$", "$")
    assert "new_node_key()" in script and ">/keys/node_key" in script
    assert 'install -m 0600 "/keys/$f" "$d/$f"' in script and "api_keys node_key" in script


def test_commands_match_the_entry_points(config: dict[str, Any]) -> None:
    """The flags compose passes exist (parsed by the services' own parsers)."""
    cluster = pytest.importorskip("host.cluster.config", reason="host/cluster not there yet")
    services = config["services"]
    for svc, parse in (("scheduler", cluster.parse_scheduler), ("gateway", cluster.parse_gateway)):
        command = services[svc]["command"]
        assert command[:3] == ["python", "-m", f"host.cluster.{svc}"]
        cfg = parse(command[3:], _env(services[svc]))
        assert urlsplit(cfg.redis).password == PASSWORD
        assert str(cfg.node_key_file) == "/etc/aenv/keys/node_key"
    from host.config import parse_config

    for node in NODES:
        cfg = parse_config([], {**_env(services[node]), "AENV_LISTEN": "0.0.0.0"})
        assert cfg.repository_spec.startswith("posix_fs:")


def _docker_daemon() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=30, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gateway_comes_up() -> None:
    """Where Docker runs: Redis, the scheduler and the gateway up, the gateway healthy on
    :8080 (the nodes need the guest build, ~15 min: `up` them by hand)."""
    if COMPOSE_CMD is None or not _docker_daemon():
        # tests/deploy/dockerd.py can start a daemon here, but `up` pulls redis:7.2-bookworm
        # and no registry is reachable from this machine
        pytest.skip("no Docker daemon answers on the default socket (and `up` needs a "
                    "registry for redis): the file is validated, not run")
    import httpx

    cmd = [*COMPOSE_CMD, "-f", str(COMPOSE), "-p", "aenv-deploy-test"]
    try:
        subprocess.run([*cmd, "up", "-d", "--build", "gateway"], check=True, timeout=1500,
                       env=ENV)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get("http://127.0.0.1:8080/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not become healthy"
            time.sleep(1)
    finally:
        subprocess.run([*cmd, "down", "-v"], check=False, timeout=300, env=ENV)
