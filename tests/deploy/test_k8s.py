"""deploy/k8s: every document validates against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), and the manifests hold together: Services select their pods and
name their ports, the node DaemonSet is privileged on the host network with /dev/kvm, its
state and the shared ReadWriteMany repository, the settings point at the Services, and
kustomization.yaml lists every manifest but the Secret of API keys. No cluster (nor kubectl)
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
    """... but the Secret of API keys, which the operator creates (applying the rest never
    overwrites it)."""
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == [m for m in MANIFESTS if m != "api-keys.yaml"]
    assert [d["kind"] for d in _docs("api-keys.yaml")] == ["Secret"]
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
    keys = env[listen_var.replace("LISTEN", "KEYS")]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols[mounts[str(Path(keys).parent)]]["secret"]["secretName"] == "aenv-api-keys"


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
    keys = mounts["/var/lib/aenv/api_keys"]
    assert keys["subPath"] == "api_keys" and keys["readOnly"] is True
    assert vols[keys["name"]]["secret"]["secretName"] == "aenv-api-keys"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"api": 3000, "proxy": 3001}


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


def test_settings_point_at_the_services() -> None:
    config = BY_KIND["ConfigMap", "aenv-config"]["data"]
    for var, service in (("AENV_CLUSTER_REDIS", "aenv-redis"),
                         ("AENV_SCHEDULER_URL", "aenv-scheduler")):
        url = urlsplit(config[var])
        svc = BY_KIND["Service", service]
        assert url.hostname == service and url.port in [p["port"] for p in svc["spec"]["ports"]]
    from host.config import parse_config

    parse_config([], {k: v for k, v in config.items() if k in {
        "AENV_REPOSITORY", "AENV_LOG_LEVEL", "AENV_LOG_FORMAT", "AENV_CLUSTER_REDIS"}})


def test_api_keys_secret_is_a_placeholder_that_fails_closed(tmp_path: Path) -> None:
    """The shipped Secret holds no key: the services refuse to start until it is replaced
    (a working key in a public manifest would be everybody's key)."""
    from host.api.auth import ApiKeys

    keys = tmp_path / "api_keys"
    keys.write_text(BY_KIND["Secret", "aenv-api-keys"]["stringData"]["api_keys"])
    with pytest.raises(ValueError, match="no API keys"):
        ApiKeys.load_or_create(keys)
    assert "create secret generic aenv-api-keys" in (K8S / "api-keys.yaml").read_text()


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
