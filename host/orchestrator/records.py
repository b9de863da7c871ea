"""Conversions between store records and the orchestrator's values.

`SandboxRecord.runtime` holds {"placement": {...} | None, "origin": <store snapshot id>,
"pending_snapshot": <runtime snapshot id> | None, "guest": <GuestDefaults as JSON>, set
for sandboxes of a built template}; `SnapshotRecord.spec` holds {"ref": <SnapshotRef as
JSON>, "envd_token": <token envd holds inside that snapshot>, "guest": <the sandbox's
GuestDefaults>}. A built template's snapshot keeps its defaults in `ref.facts["guest"]`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from host.contract import GuestDefaults, MachineSpec, Placement, SnapshotRef

from .model import NetworkConfig, SandboxInfo, SnapshotInfo
from .states import SandboxState
from .store import SandboxRecord, SnapshotRecord

ENVD_VERSION = "0.6.13"


def network_to_json(net: NetworkConfig) -> dict[str, Any]:
    d = dataclasses.asdict(net)
    d["allow_out"] = list(net.allow_out)
    d["deny_out"] = list(net.deny_out)
    return d


def network_from_json(d: dict[str, Any]) -> NetworkConfig:
    if not d:
        return NetworkConfig()
    return NetworkConfig(
        allow_internet_access=bool(d.get("allow_internet_access", True)),
        allow_public_traffic=bool(d.get("allow_public_traffic", True)),
        allow_out=tuple(d.get("allow_out", ())), deny_out=tuple(d.get("deny_out", ())),
        mask_request_host=d.get("mask_request_host"), extra=dict(d.get("extra", {})))


def ref_to_json(ref: SnapshotRef) -> dict[str, Any]:
    return {"snapshot_id": ref.snapshot_id, "machine": dataclasses.asdict(ref.machine),
            "created_at": ref.created_at, "parent_id": ref.parent_id, "facts": ref.facts}


def ref_from_json(d: dict[str, Any]) -> SnapshotRef:
    return SnapshotRef(snapshot_id=d["snapshot_id"], machine=MachineSpec(**d["machine"]),
                       created_at=float(d["created_at"]), parent_id=d.get("parent_id"),
                       facts=dict(d.get("facts") or {}))


def snapshot_ref(snap: SnapshotRecord) -> SnapshotRef:
    return ref_from_json(snap.spec["ref"])


def without_memory(ref: SnapshotRef) -> bool:
    """A filesystem-only snapshot: nothing to restore, a start cold-boots its disk."""
    return (ref.facts or {}).get("memory", True) is None


def guest_from_json(d: dict[str, Any] | None) -> GuestDefaults | None:
    """GuestDefaults from JSON (None: none recorded, envd's defaults apply)."""
    if not d:
        return None
    base = GuestDefaults()
    return GuestDefaults(user=str(d.get("user") or base.user),
                         workdir=str(d.get("workdir") or base.workdir),
                         env={str(k): str(v) for k, v in (d.get("env") or {}).items()})


def guest_to_json(g: GuestDefaults) -> dict[str, Any]:
    return {"user": g.user, "workdir": g.workdir, "env": dict(g.env)}


def snapshot_guest(snap: SnapshotRecord) -> dict[str, Any] | None:
    """The guest defaults a sandbox started from `snap` gets: those of the sandbox it was
    taken of, else those of the built template it is (`ref.facts["guest"]`)."""
    if snap.spec.get("guest"):
        return dict(snap.spec["guest"])
    facts = (snap.spec.get("ref") or {}).get("facts") or {}
    return dict(facts["guest"]) if facts.get("guest") else None


def guest_of(rec: SandboxRecord) -> GuestDefaults | None:
    return guest_from_json(rec.runtime.get("guest"))


def placement_to_json(p: Placement) -> dict[str, Any]:
    return {"envd_host": p.envd_host, "envd_port": p.envd_port, "facts": p.facts}


def placement_of(rec: SandboxRecord) -> Placement | None:
    d = rec.runtime.get("placement")
    if not d:
        return None
    return Placement(sandbox_id=rec.id, envd_host=d["envd_host"], envd_port=int(d["envd_port"]),
                     facts=dict(d.get("facts") or {}))


# a record's runtime key: paused by a drain (drain.py), resumed by the next start
DRAINED = "drained"


def drained(runtime: dict[str, Any]) -> bool:
    return bool(runtime.get(DRAINED))


def with_runtime(rec: SandboxRecord, **changes: Any) -> dict[str, Any]:
    """`rec.runtime` with keys changed (None removes a key)."""
    out = dict(rec.runtime)
    for k, v in changes.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def sandbox_info(rec: SandboxRecord, *, now: float | None = None) -> SandboxInfo:
    now = time.time() if now is None else now
    if rec.end_at is not None:
        end_at = rec.end_at
    else:  # paused: the TTL left counts from the moment it is resumed
        end_at = now + (rec.ttl_left_s or 0.0)
    return SandboxInfo(
        sandbox_id=rec.id, template_id=rec.template_id, alias=rec.alias, state=rec.state,
        cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_mb=rec.disk_mb,
        started_at=rec.started_at, end_at=end_at, envd_version=ENVD_VERSION,
        envd_access_token=rec.envd_token, traffic_access_token=rec.traffic_token,
        metadata=dict(rec.metadata), auto_pause=rec.auto_pause, auto_resume=rec.auto_resume,
        network=network_from_json(rec.network),
        pause_mode=_pause_mode(rec),
        volume_mounts=tuple((m["name"], m["path"])
                            for m in rec.runtime.get("volume_mounts") or ()))


def _pause_mode(rec: SandboxRecord) -> str | None:
    """"full" or "filesystem" once paused, and while its pause is being written."""
    if rec.state is SandboxState.PAUSED:
        return rec.runtime.get("pause_mode")
    if rec.state is SandboxState.PAUSING:
        return (rec.runtime.get("pending") or {}).get("mode")
    return None


def snapshot_info(snap: SnapshotRecord) -> SnapshotInfo:
    return SnapshotInfo(snapshot_id=snap.id, names=(snap.id,), sandbox_id=snap.sandbox_id,
                        created_at=snap.created_at)


# States shown to the API as running / paused (see SandboxState.public).
PUBLIC_RUNNING = frozenset({SandboxState.RUNNING, SandboxState.RESUMING,
                            SandboxState.SNAPSHOTTING, SandboxState.FORKING})
PUBLIC_PAUSED = frozenset({SandboxState.PAUSED, SandboxState.PAUSING})
# States in which the VM is up and its placement valid.
LIVE = frozenset({SandboxState.RUNNING, SandboxState.SNAPSHOTTING, SandboxState.FORKING})
GONE = frozenset({SandboxState.KILLING, SandboxState.KILLED})


def expand_states(states: frozenset[SandboxState] | None) -> frozenset[SandboxState]:
    if states is None:
        return PUBLIC_RUNNING | PUBLIC_PAUSED
    out: set[SandboxState] = set()
    for s in states:
        if s is SandboxState.RUNNING:
            out |= PUBLIC_RUNNING
        elif s is SandboxState.PAUSED:
            out |= PUBLIC_PAUSED
        else:
            out.add(s)
    return frozenset(out)


def snapshot_record(store_id: str, kind: str, ref: SnapshotRef, rec: SandboxRecord,
                    name: str | None = None) -> SnapshotRecord:
    """The store's record of a snapshot of `rec`'s sandbox (kind: pause, fork, named)."""
    return SnapshotRecord(id=store_id, kind=kind, created_at=ref.created_at,
                          sandbox_id=rec.id, name=name, parent_id=ref.parent_id,
                          spec={"ref": ref_to_json(ref), "envd_token": rec.envd_token,
                                "template_id": rec.template_id,
                                **({"guest": rec.runtime["guest"]}
                                   if rec.runtime.get("guest") else {})})
