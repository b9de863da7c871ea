"""deploy/k8s: every document validates against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), and the manifests hold together: Services select their pods and
name their ports, the node DaemonSet is privileged on the host network with /dev/kvm, its
state and the shared ReadWriteMany repository, the settings point at the Services, Redis
requires the password of its Secret and every client's URL carries it, the node key is a
Secret of its own, and kustomization.yaml lists every manifest but the Secrets (the
operator makes them; their templates fail closed). No cluster (nor kubectl)
is on this machine, so nothing is applied: `test_applies_to_a_cluster` does a server-side
dry run where kubectl reaches one."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# Secret templates, not applied with the rest: the operator creates the real ones
SECRETS = {"api-keys.yaml": "aenv-api-keys", "node-key.yaml": "aenv-node-key",
           "redis-password.yaml": "aenv-redis"}
# the oldest still supported upstream when written, and the newest the package knows
VERSIONS = ("1.32.0", "latest")

kv = pytest.importorskip("kubernetes_validate")


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


DOCS = [(name, i, doc) for name in MANIFESTS for i, doc in enumerate(_docs(name))]
BY_KIND: dict[tuple[str, str], dict[str, Any]] = {
    (d["kind"], d["metadata"]["name"]): d for _, _, d in DOCS}


def _version(v: str) -> str:
    return str(kv.latest_version()) if v == "latest" else v


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), DOCS,
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, _, d in DOCS])
def test_document_validates_strictly(name: str, index: int, doc: dict[str, Any],
                                     version: str) -> None:
    kv.validate(doc, _version(version), strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    doc = copy.deepcopy(BY_KIND["DaemonSet", "aenv-node"])
    doc["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, _version("latest"), strict=True)
    doc = copy.deepcopy(BY_KIND["Service", "aenv-gateway"])
    doc["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, _version("latest"), strict=True)


def test_kustomization_lists_every_manifest_and_image() -> None:
    """... but the Secrets, which the operator creates (applying the rest never overwrites
    them)."""
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == [m for m in MANIFESTS if m not in SECRETS]
    for name, secret in SECRETS.items():
        assert [(d["kind"], d["metadata"]["name"]) for d in _docs(name)] == [("Secret", secret)]
    assert all(d["metadata"].get("namespace", k["namespace"]) == k["namespace"]
               for _, _, d in DOCS if d["kind"] != "Namespace")
    assert BY_KIND["Namespace", k["namespace"]]
    ours = {c["image"].split(":")[0] for c in _containers() if "aenv" in c["image"]}
    assert ours == {i["name"] for i in k["images"]}


def _workloads() -> list[dict[str, Any]]:
    return [d for _, _, d in DOCS if d["kind"] in ("Deployment", "DaemonSet")]


def _containers() -> list[dict[str, Any]]:
    pods = [w["spec"]["template"]["spec"] for w in _workloads()]
    return [c for p in pods for c in p.get("initContainers", []) + p["containers"]]


def test_workloads_select_their_own_pods() -> None:
    for w in _workloads():
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]


@pytest.mark.parametrize("service", ["aenv-redis", "aenv-scheduler", "aenv-gateway"])
def test_service_selects_its_pods_and_ports(service: str) -> None:
    svc = BY_KIND["Service", service]
    selected = [w for w in _workloads() if svc["spec"]["selector"].items()
                <= w["spec"]["template"]["metadata"]["labels"].items()]
    assert [w["metadata"]["name"] for w in selected] == [service]
    ports = {p["name"]: p["containerPort"]
             for c in selected[0]["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in ports
        assert p["port"] == ports[p["targetPort"]]


@pytest.mark.parametrize(("name", "port", "listen_var"),
                         [("aenv-gateway", 8080, "AENV_GATEWAY_LISTEN"),
                          ("aenv-scheduler", 9090, "AENV_SCHEDULER_LISTEN")])
def test_cluster_service_probes_and_listens(name: str, port: int, listen_var: str) -> None:
    dep = BY_KIND["Deployment", name]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", f"host.cluster.{name.removeprefix('aenv-')}"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[listen_var] == f"0.0.0.0:{port}"
    assert c["ports"] == [{"name": "http", "containerPort": port}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "tcpSocket" in c["livenessProbe"] or "httpGet" in c["livenessProbe"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["replicas"] >= 2  # stateless: state is in Redis
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}

    def secret_of(path: str) -> str:
        return str(vols[mounts[str(Path(path).parent)]]["secret"]["secretName"])

    # both call into nodes with the node key; only the gateway takes clients' API keys
    assert secret_of(env["AENV_NODE_KEY_FILE"]) == "aenv-node-key"
    secrets = {v["secret"]["secretName"] for v in vols.values() if "secret" in v}
    if name == "aenv-gateway":
        assert secret_of(env["AENV_GATEWAY_KEYS"]) == "aenv-api-keys"
        assert secrets == {"aenv-api-keys", "aenv-node-key"}
    else:
        assert secrets == {"aenv-node-key"}


def _node() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = BY_KIND["DaemonSet", "aenv-node"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def test_node_daemonset_is_a_privileged_host_network_kvm_pod() -> None:
    pod, c = _node()
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # reaches aenv-redis by name
    assert c["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    kvm = vols[mounts["/dev/kvm"]["name"]]["hostPath"]
    assert kvm == {"path": "/dev/kvm", "type": "CharDevice"}
    state = vols[mounts["/var/lib/aenv"]["name"]]["hostPath"]
    assert state["path"] == "/var/lib/aenv"
    for path, secret in (("api_keys", "aenv-api-keys"), ("node_key", "aenv-node-key")):
        keys = mounts[f"/var/lib/aenv/{path}"]   # where the node reads them (its state dir)
        assert keys["subPath"] == path and keys["readOnly"] is True
        assert vols[keys["name"]]["secret"]["secretName"] == secret
        assert vols[keys["name"]]["secret"]["defaultMode"] == 0o400
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"api": 3000, "proxy": 3001}
    # a pod's VMs die with it: SIGTERM drains them (paused, committed) within the grace
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["AENV_DRAIN_ON_STOP"] == "1" and pod["terminationGracePeriodSeconds"] >= 300


def test_node_shares_one_read_write_many_repository() -> None:
    pod, c = _node()
    config = BY_KIND["ConfigMap", "aenv-config"]["data"]
    repo_path = config["AENV_REPOSITORY"].removeprefix("posix_fs:")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claim = {v["name"]: v for v in pod["volumes"]}[mounts[repo_path]]
    pvc = BY_KIND["PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"]]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert {"configMapRef": {"name": "aenv-config"}} in c["envFrom"]


def test_node_joins_the_cluster_at_its_host_address() -> None:
    pod, c = _node()
    env = {e["name"]: e for e in c["env"]}
    assert env["AENV_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    names = list(env)
    for var in ("AENV_LISTEN", "AENV_ADVERTISE_URL"):  # $(HOST_IP) defined before its use
        assert "$(HOST_IP)" in env[var]["value"] and names.index("HOST_IP") < names.index(var)
    assert env["AENV_ADVERTISE_URL"]["value"] == "http://$(HOST_IP):3000"
    (init,) = pod["initContainers"]
    assert init["command"] == ["make", "-C", "/opt/aenv", "envd", "kernel", "image"]
    cache = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/var/cache/aenv"]
    assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}["/var/cache/aenv"] == cache


def _redis_clients() -> list[tuple[str, dict[str, Any]]]:
    return [(w["metadata"]["name"], c) for w in _workloads()
            if w["metadata"]["name"] != "aenv-redis"
            for c in w["spec"]["template"]["spec"]["containers"]]


def test_settings_point_at_the_services() -> None:
    config = BY_KIND["ConfigMap", "aenv-config"]["data"]
    assert "AENV_CLUSTER_REDIS" not in config   # it carries a password: per workload
    urls = {"AENV_SCHEDULER_URL": config["AENV_SCHEDULER_URL"]}
    urls |= {f"AENV_CLUSTER_REDIS ({name})": next(e["value"] for e in c["env"]
                                                  if e["name"] == "AENV_CLUSTER_REDIS")
             for name, c in _redis_clients()}
    for var, raw in urls.items():
        url = urlsplit(raw)
        service = "aenv-scheduler" if var == "AENV_SCHEDULER_URL" else "aenv-redis"
        svc = BY_KIND["Service", service]
        assert url.hostname == service and url.port in [p["port"] for p in svc["spec"]["ports"]]
    from host.config import parse_config

    redis_url = urls["AENV_CLUSTER_REDIS (aenv-node)"].replace("$(REDIS_PASSWORD)", "pw")
    cfg = parse_config([], {**{k: v for k, v in config.items() if k in {
        "AENV_REPOSITORY", "AENV_LOG_LEVEL", "AENV_LOG_FORMAT"}}, "AENV_CLUSTER_REDIS": redis_url})
    assert urlsplit(cfg.cluster_redis or "").password == "pw"


def _secret_ref(env: dict[str, Any]) -> tuple[str, str]:
    ref = env["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_every_redis_client_sends_the_secret_password() -> None:
    """Gateway, scheduler and node: REDIS_PASSWORD from the aenv-redis Secret, defined
    before the URL that expands it (Kubernetes expands $(VAR) of variables above only)."""
    clients = _redis_clients()
    assert sorted(n for n, _ in clients) == ["aenv-gateway", "aenv-node", "aenv-scheduler"]
    for name, c in clients:
        env = {e["name"]: e for e in c["env"]}
        names = list(env)
        assert _secret_ref(env["REDIS_PASSWORD"]) == ("aenv-redis", "password"), name
        assert names.index("REDIS_PASSWORD") < names.index("AENV_CLUSTER_REDIS"), name
        url = urlsplit(env["AENV_CLUSTER_REDIS"]["value"])
        assert url.scheme == "redis" and url.password == "$(REDIS_PASSWORD)", name


def _redis_container() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = BY_KIND["Deployment", "aenv-redis"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def test_redis_requires_the_secret_password(tmp_path: Path) -> None:
    """The redis container's script run here with redis-server: the password of the Secret
    lands in a 0600 file (never on the command line), clients without it get NOAUTH, the
    readiness probe passes with it only; an empty Secret fails the start."""
    from .redis_script import fails, redis_cli, run_script

    pod, c = _redis_container()
    env = {e["name"]: e for e in c["env"]}
    assert _secret_ref(env["REDISCLI_AUTH"]) == ("aenv-redis", "password")
    assert c["command"] == ["/bin/sh", "-ec"]
    (script,) = c["args"]
    assert "requirepass" in script and "exec redis-server /tmp/redis.conf" in script
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    tmp = {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]
    assert tmp["emptyDir"]["medium"] == "Memory"   # the password file never hits a disk
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    probe = c["readinessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"]
    with run_script(script, tmp_path, {"REDISCLI_AUTH": "pw"}) as port:
        assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
        assert redis_cli(port, "pw", probe[2]).returncode == 0
        assert redis_cli(port, "wrong", probe[2]).returncode != 0
        assert redis_cli(port, None, probe[2]).returncode != 0
    shipped = BY_KIND["Secret", "aenv-redis"]["stringData"]["password"]
    assert "no password" in fails(script, {"REDISCLI_AUTH": shipped})


def test_api_keys_secret_is_a_placeholder_that_fails_closed(tmp_path: Path) -> None:
    """The shipped Secret holds no key: the services refuse to start until it is replaced
    (a working key in a public manifest would be everybody's key)."""
    from host.api.auth import ApiKeys

    keys = tmp_path / "api_keys"
    keys.write_text(BY_KIND["Secret", "aenv-api-keys"]["stringData"]["api_keys"])
    with pytest.raises(ValueError, match="no API keys"):
        ApiKeys.load_or_create(keys)
    assert "create secret generic aenv-api-keys" in (K8S / "api-keys.yaml").read_text()


def test_node_key_secret_is_a_placeholder_that_fails_closed(tmp_path: Path) -> None:
    from host.api.auth import NodeKeys

    key = tmp_path / "node_key"
    key.write_text(BY_KIND["Secret", "aenv-node-key"]["stringData"]["node_key"])
    with pytest.raises(ValueError, match="no node key"):
        NodeKeys.load(key)
    with pytest.raises(ValueError, match="no node key"):   # a node does not invent one either
        NodeKeys.load_or_create(key)
    assert "create secret generic aenv-node-key" in (K8S / "node-key.yaml").read_text()


def test_applies_to_a_cluster() -> None:
    """Where kubectl reaches a cluster: the API server accepts the manifests (dry run)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None or subprocess.run([kubectl, "version"], capture_output=True,
                                         timeout=30, check=False).returncode != 0:
        pytest.skip("no Kubernetes cluster (nor kubectl) on this machine: the manifests are "
                    "validated against the schemas only")
    p = subprocess.run([kubectl, "apply", "--dry-run=server", "-k", str(K8S)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
