"""deploy/compose: the cluster simulation's file under `docker-compose config` (validation
without a daemon), and its wiring read from the resolved configuration: five services and
their start order, the shared repository in both nodes, each node's own state, the gateway
published on :8080, the cluster settings pointing at the right services. Running it needs a
Docker daemon (and KVM for useful speed): `test_gateway_comes_up` runs only where there is one.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose" / "docker-compose.yml"
NODES = ("node-a", "node-b")


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
    if COMPOSE_CMD is None:
        return dict(yaml.safe_load(COMPOSE.read_text()))
    out = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return dict(yaml.safe_load(out))


@needs_compose
def test_compose_config_is_valid() -> None:
    assert COMPOSE_CMD is not None
    p = subprocess.run([*COMPOSE_CMD, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


@needs_compose
def test_compose_config_catches_a_broken_file(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("privileged: true", "privileged: maybe", 1))
    assert COMPOSE_CMD is not None
    p = subprocess.run([*COMPOSE_CMD, "-f", str(broken), "config", "-q"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode != 0


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
    redis_urls = {_flag(services[s]["command"], "--redis") for s in ("scheduler", "gateway")}
    redis_urls |= {_env(services[n])["AENV_CLUSTER_REDIS"] for n in NODES}
    assert {urlsplit(u).netloc for u in redis_urls} == {"redis:6379"}
    sched_listen = _flag(services["scheduler"]["command"], "--listen")
    assert _env(services["gateway"])["AENV_SCHEDULER_URL"] == \
        f"http://scheduler:{sched_listen.rsplit(':', 1)[1]}"
    assert _flag(services["gateway"]["command"], "--listen") == "0.0.0.0:8080"
    for node in NODES:
        env = _env(services[node])
        assert env["AENV_NODE_ID"] == node
        assert env["AENV_ADVERTISE_URL"] == f"http://{node}:3000"
    for svc in ("scheduler", "gateway"):
        keys_var = {"scheduler": "AENV_SCHEDULER_KEYS", "gateway": "AENV_GATEWAY_KEYS"}[svc]
        keys = _env(services[svc])[keys_var]
        assert _volumes(services[svc])[str(Path(keys).parent)] == "keys"


def test_commands_match_the_entry_points(config: dict[str, Any]) -> None:
    """The flags compose passes exist (parsed by the services' own parsers)."""
    cluster = pytest.importorskip("host.cluster.config", reason="host/cluster not there yet")
    services = config["services"]
    for svc, parse in (("scheduler", cluster.parse_scheduler), ("gateway", cluster.parse_gateway)):
        command = services[svc]["command"]
        assert command[:3] == ["python", "-m", f"host.cluster.{svc}"]
        parse(command[3:], _env(services[svc]))
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
        pytest.skip("no Docker daemon on this machine: the file is validated, not run")
    import httpx

    cmd = [*COMPOSE_CMD, "-f", str(COMPOSE), "-p", "aenv-deploy-test"]
    try:
        subprocess.run([*cmd, "up", "-d", "--build", "gateway"], check=True, timeout=1500)
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
        subprocess.run([*cmd, "down", "-v"], check=False, timeout=300)
