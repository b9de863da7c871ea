"""`RunningSandbox`: what the runtime knows about one live sandbox VM, and its facts.

The facts are what the orchestrator persists and hands back to `adopt()` after a restart;
`RunningSandbox.facts()` writes them and `adoption.py` reads them back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from host.contract import MachineSpec, NetworkConfig, Placement
from host.network import NetworkPolicy
from host.vmm.driver import ENVD_PORT, Vm


def policy_of(cfg: NetworkConfig) -> NetworkPolicy:
    return NetworkPolicy(allow_internet_access=cfg.allow_internet_access,
                         allow_out=tuple(cfg.allow_out), deny_out=tuple(cfg.deny_out))


def policy_to_dict(p: NetworkPolicy) -> dict[str, Any]:
    return {"allow_internet_access": p.allow_internet_access, "allow_out": list(p.allow_out),
            "deny_out": list(p.deny_out)}


def policy_from_dict(d: dict[str, Any]) -> NetworkPolicy:
    return NetworkPolicy(allow_internet_access=d.get("allow_internet_access", True),
                         allow_out=tuple(d.get("allow_out", ())),
                         deny_out=tuple(d.get("deny_out", ())))


def boot_of(m: dict[str, Any]) -> dict[str, Any]:
    """What a VM started from manifest `m` boots (carried into its own snapshots, so they
    do not depend on `m` still existing)."""
    return {"image": m.get("image"), "kernel": m["kernel"], "cmdline": m["cmdline"]}


def disk_base(m: dict[str, Any], sandbox_id: str) -> int:
    """How many of manifest `m`'s layers a sandbox started from it shares with other
    stacks (compaction.py never merges those): all of them, unless `m` is the sandbox's
    own snapshot (a resume), which records where its own layers began."""
    n = len(m["disk"]["layers"])
    if m.get("sandbox_id") != sandbox_id:
        return n
    return min(int(m["disk"].get("base", n)), n)


@dataclass
class RunningSandbox:
    sandbox_id: str
    vm: Vm
    mode: str                      # "netns" | "user"
    stack: str
    snapshot_id: str               # restored from
    base_dir: Path | None          # memory base it maps (None: cold-booted, see `scratch`)
    memsnap_dir: Path | None       # parent for the next memory delta
    config_sha256: str
    machine: MachineSpec
    envd_host: str
    envd_port: int
    policy: NetworkPolicy
    host_port: int | None = None
    scratch: Path | None = None    # cold-booted: its RAM file (share=on); snapshots freeze it
    boot: dict[str, Any] = field(default_factory=dict)  # image, kernel, cmdline it runs
    vmm: dict[str, Any] | None = None  # VmmIdentity it runs under (None: not known)
    memory_sha256: dict[str, str] = field(default_factory=dict)  # of the files it maps
    # its stack's layers below this index are shared (a template's, a fork source's);
    # None: not known (facts of an older service), so nothing is compacted
    disk_base: int | None = None
    # restored for a create that has not come yet, its vCPUs stopped (starts.start(hold=True))
    held: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timings: dict[str, float] = field(default_factory=dict)

    def facts(self) -> dict[str, Any]:
        f: dict[str, Any] = {
            "vm": self.vm.facts(), "pid": self.vm.pid, "work_dir": str(self.vm.work_dir),
            "mode": self.mode, "stack": self.stack, "snapshot_id": self.snapshot_id,
            "base_dir": str(self.base_dir) if self.base_dir else None,
            "memsnap_dir": str(self.memsnap_dir) if self.memsnap_dir else None,
            "scratch": str(self.scratch) if self.scratch else None, "boot": self.boot,
            "config_sha256": self.config_sha256, "machine": dataclasses.asdict(self.machine),
            "vmm": self.vmm, "memory_sha256": self.memory_sha256,
            "envd_host": self.envd_host, "envd_port": self.envd_port,
            "policy": policy_to_dict(self.policy), "disk_base": self.disk_base,
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }
        if self.host_port is not None:
            f["port_forwards"] = {str(ENVD_PORT): self.host_port}
        return f

    def placement(self) -> Placement:
        return Placement(self.sandbox_id, self.envd_host, self.envd_port, self.facts())

    @classmethod
    def from_facts(cls, sandbox_id: str, vm: Vm, facts: dict[str, Any]) -> RunningSandbox:
        """Raises KeyError/TypeError/ValueError on facts it cannot read."""
        return cls(
            sandbox_id=sandbox_id, vm=vm, mode=str(facts["mode"]), stack=str(facts["stack"]),
            snapshot_id=str(facts["snapshot_id"]),
            base_dir=Path(facts["base_dir"]) if facts.get("base_dir") else None,
            scratch=Path(facts["scratch"]) if facts.get("scratch") else None,
            boot=dict(facts.get("boot") or {}),
            memsnap_dir=Path(facts["memsnap_dir"]) if facts.get("memsnap_dir") else None,
            config_sha256=str(facts["config_sha256"]),
            vmm=dict(facts["vmm"]) if facts.get("vmm") else None,
            memory_sha256=dict(facts.get("memory_sha256") or {}),
            machine=MachineSpec(**facts["machine"]), envd_host=str(facts["envd_host"]),
            envd_port=int(facts["envd_port"]),
            policy=policy_from_dict(facts.get("policy") or {}),
            disk_base=int(facts["disk_base"]) if facts.get("disk_base") is not None else None,
            host_port=(int(facts["port_forwards"][str(ENVD_PORT)])
                       if facts.get("port_forwards") else None))
