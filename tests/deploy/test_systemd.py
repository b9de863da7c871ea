"""deploy/systemd: the units under `systemd-analyze verify` and `security`, their hardening
choices, the env files against the settings the services read, and the cluster services'
entry points as the units start them. (The same units installed by install.sh on a fresh
root: test_install.py.) Starting the units needs systemd as PID 1, which neither this machine
nor a chroot has: their sandboxing is checked by systemd's analyzers and, for
MemoryDenyWriteExecute=, by the kernel's own W^X switch."""

from __future__ import annotations

import configparser
import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
ROLES = ("node", "gateway", "scheduler")
UNITS = [f"aenv-{r}.service" for r in ROLES]
HOST_UNITS = Path("/usr/lib/systemd/system")
# options that give a service a mount namespace of its own (see aenv-node.service)
MOUNT_NS_OPTIONS = ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                    "PrivateMounts", "ProtectKernelTunables", "ProtectKernelModules",
                    "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
                    "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "TemporaryFileSystem",
                    "BindPaths", "BindReadOnlyPaths", "ProtectHostname", "ProtectClock")

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not HOST_UNITS.is_dir(),
    reason="systemd-analyze or the system's unit directory is missing")


def _unit(role: str) -> configparser.RawConfigParser:
    cp = configparser.RawConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read(SYSTEMD / f"aenv-{role}.service")
    return cp


@pytest.fixture
def unit_root(tmp_path: Path) -> Path:
    """A root with the units installed, the system's targets, and an executable where
    ExecStart points (verify checks it)."""
    root = tmp_path / "root"
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(HOST_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "lib").symlink_to("usr/lib")
    (root / "etc/systemd/system").mkdir(parents=True)
    for u in UNITS:
        shutil.copy(SYSTEMD / u, root / "etc/systemd/system" / u)
    py = root / "opt/aenv/.venv/bin/python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    return root


@needs_systemd_analyze
def test_units_verify(unit_root: Path) -> None:
    p = subprocess.run(["systemd-analyze", "verify", f"--root={unit_root}", *UNITS],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr


@needs_systemd_analyze
def test_verify_catches_a_broken_unit(unit_root: Path) -> None:
    """The check above can fail: a misspelt value and a missing binary are reported."""
    broken = unit_root / "etc/systemd/system/aenv-broken.service"
    broken.write_text((SYSTEMD / "aenv-gateway.service").read_text()
                      .replace("Restart=on-failure", "Restart=on-failur")
                      .replace("/opt/aenv/.venv/bin/python", "/opt/aenv/missing"))
    p = subprocess.run(["systemd-analyze", "verify", f"--root={unit_root}", broken.name],
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode != 0
    assert "on-failur" in p.stderr and "/opt/aenv/missing" in p.stderr


@needs_systemd_analyze
@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_units_are_sandboxed(unit_root: Path, role: str) -> None:
    """gateway and scheduler need nothing but TCP: `systemd-analyze security` rates them OK
    (exposure under 2 of 10; a default service rates 9.6)."""
    p = subprocess.run(["systemd-analyze", "security", "--offline=true", f"--root={unit_root}",
                        f"aenv-{role}.service"], capture_output=True, text=True, timeout=60,
                       check=False)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", p.stdout)
    assert m, p.stdout + p.stderr
    assert float(m.group(1)) < 2.0, p.stdout


def test_node_unit_keeps_what_a_vmm_host_needs() -> None:
    svc = dict(_unit("node")["Service"])
    assert "User" not in svc and "DynamicUser" not in svc  # root: /dev/kvm, netns, nftables
    assert svc["KillMode"] == "process"  # VMs outlive a restart and are adopted
    assert svc["RuntimeDirectoryPreserve"] == "yes"
    assert svc["StateDirectory"] == "aenv" and svc["StateDirectoryMode"] == "0700"
    assert not [o for o in MOUNT_NS_OPTIONS if o in svc]
    assert "MemoryDenyWriteExecute" not in svc  # QEMU's TCG is a JIT
    assert svc["ExecStart"] == "/opt/aenv/.venv/bin/python -m host"
    assert svc["EnvironmentFile"] == "/etc/aenv/node.env"
    assert svc["Restart"] == "on-failure"


def _values(role: str, option: str) -> list[str]:
    """Every value of a repeatable option of the unit's [Service] (configparser keeps the
    last only)."""
    return [ln.split("=", 1)[1] for ln in (SYSTEMD / f"aenv-{role}.service").read_text()
            .splitlines() if ln.startswith(f"{option}=")]


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_unit_runs_unprivileged_with_the_shared_keys(role: str) -> None:
    """Both get the cluster's node key as a credential; only the gateway the clients' API
    keys (a client key opens no cluster route, and the scheduler takes none)."""
    svc = dict(_unit(role)["Service"])
    assert svc["DynamicUser"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["CapabilityBoundingSet"] == "" and svc["NoNewPrivileges"] == "yes"
    assert svc["ExecStart"] == f"/opt/aenv/.venv/bin/python -m host.cluster.{role}"
    assert svc["EnvironmentFile"] == f"/etc/aenv/{role}.env"
    credentials = {"node_key:/etc/aenv/node_key"}
    environment = {"AENV_NODE_KEY_FILE=%d/node_key"}
    if role == "gateway":
        credentials.add("api_keys:/etc/aenv/api_keys")
        environment.add("AENV_GATEWAY_KEYS=%d/api_keys")
    assert set(_values(role, "LoadCredential")) == credentials
    assert environment <= set(_values(role, "Environment"))


def _env_names(path: Path) -> dict[str, bool]:
    """Variables an env file names: {name: set (True) or only shown commented (False)}."""
    names: dict[str, bool] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(#?)([A-Z][A-Z0-9_]*)=", line)
        if m:
            names[m.group(2)] = names.get(m.group(2), False) or not m.group(1)
        else:
            assert not line.strip() or line.startswith("#"), f"{path.name}: {line!r}"
    return names


def test_node_env_names_every_setting_of_the_node() -> None:
    from host.config import _ENV

    names = _env_names(SYSTEMD / "node.env")
    missing = sorted(var for var, _ in _ENV.values() if var not in names)
    assert not missing, f"add to deploy/systemd/node.env: {missing}"
    cluster = {"AENV_CLUSTER_REDIS", "AENV_NODE_ID", "AENV_ADVERTISE_URL"}
    assert cluster <= names.keys()
    assert names["AENV_CACHE"]  # the unit's CacheDirectory, set explicitly


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_env_names_every_setting_of_its_service(role: str) -> None:
    config = pytest.importorskip("host.cluster.config", reason="host/cluster not there yet")
    table = {"gateway": "_GATEWAY_ENV", "scheduler": "_SCHEDULER_ENV"}[role]
    names = _env_names(SYSTEMD / f"{role}.env")
    missing = sorted(v for v in getattr(config, table).values() if v not in names)
    assert not missing, f"add to deploy/systemd/{role}.env: {missing}"
    assert names["AENV_CLUSTER_REDIS"]


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_env_defaults_parse(role: str) -> None:
    """The shipped env files are a valid configuration of their service."""
    config = pytest.importorskip("host.cluster.config", reason="host/cluster not there yet")
    env = {k: v for k, v in (ln.split("=", 1) for ln in (SYSTEMD / f"{role}.env")
                             .read_text().splitlines() if ln and not ln.startswith("#"))}
    cfg = getattr(config, f"parse_{role}")([], env)
    assert cfg.address[1] == {"gateway": 8080, "scheduler": 9090}[role]


def _entry_point(role: str) -> None:
    if not (REPO / "host" / "cluster" / role / "__main__.py").is_file():
        pytest.skip(f"python -m host.cluster.{role} does not exist yet")


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_entry_point_help(role: str) -> None:
    _entry_point(role)
    p = subprocess.run([sys.executable, "-m", f"host.cluster.{role}", "--help"],
                       capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    assert "--redis" in p.stdout and "--listen" in p.stdout


@pytest.mark.parametrize("role", ["gateway", "scheduler"])
def test_cluster_stack_runs_without_writable_executable_memory(role: str) -> None:
    """The units set MemoryDenyWriteExecute=yes: the service's imports work with the kernel's
    equivalent (prctl PR_SET_MDWE, Linux >= 6.3) set before Python starts."""
    _entry_point(role)
    if ctypes.CDLL(None).prctl(66, 0, 0, 0, 0) < 0:  # PR_GET_MDWE
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    child = (f"import mmap, ssl, host.cluster.{role}.__main__\n"
             "ssl.create_default_context()\n"
             "try:\n"
             "    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
             "except PermissionError:\n"
             "    print('refused: W+X memory')\n")
    code = ("import ctypes, os, sys\n"
            "if ctypes.CDLL(None).prctl(65, 1, 0, 0, 0):  # PR_SET_MDWE, REFUSE_EXEC_GAIN\n"
            "    sys.exit('PR_SET_MDWE failed')\n"
            f"os.execv(sys.executable, [sys.executable, '-c', {child!r}])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=REPO, check=False)
    assert p.returncode == 0, p.stderr
    assert "refused: W+X memory" in p.stdout  # the restriction was in force
