"""Orchestrator values -> E2B JSON objects (field names exactly as in the OpenAPI spec)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from host.orchestrator.model import (
    ForkResult,
    LogLine,
    Metric,
    NetworkConfig,
    SandboxInfo,
    SnapshotInfo,
)


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def sandbox(info: SandboxInfo, domain: str | None, *, with_token: bool = True) -> dict[str, Any]:
    """`Sandbox` (create / connect / fork)."""
    return {
        "templateID": info.template_id,
        "sandboxID": info.sandbox_id,
        "clientID": info.client_id,
        "envdVersion": info.envd_version,
        **({"alias": info.alias} if info.alias else {}),
        **({"envdAccessToken": info.envd_access_token}
           if with_token and info.envd_access_token else {}),
        "trafficAccessToken": info.traffic_access_token,
        "domain": domain,
    }


def network(net: NetworkConfig) -> dict[str, Any]:
    out: dict[str, Any] = dict(net.extra)
    out.update({
        "allowPublicTraffic": net.allow_public_traffic,
        "allowOut": list(net.allow_out),
        "denyOut": list(net.deny_out),
    })
    if net.mask_request_host:
        out["maskRequestHost"] = net.mask_request_host
    return out


def listed_sandbox(info: SandboxInfo) -> dict[str, Any]:
    """`ListedSandbox` (list items)."""
    return {
        "templateID": info.template_id,
        "sandboxID": info.sandbox_id,
        "clientID": info.client_id,
        **({"alias": info.alias} if info.alias else {}),
        "startedAt": rfc3339(info.started_at),
        "endAt": rfc3339(info.end_at),
        "cpuCount": info.cpu_count,
        "memoryMB": info.memory_mb,
        "diskSizeMB": info.disk_mb,
        "state": info.state.public,
        "envdVersion": info.envd_version,
        "metadata": dict(info.metadata),
        "volumeMounts": [],
    }


def sandbox_detail(info: SandboxInfo, domain: str | None) -> dict[str, Any]:
    """`SandboxDetail` (GET one); carries the token and domain for JS 1.x `connect`."""
    out = listed_sandbox(info)
    if info.envd_access_token:
        out["envdAccessToken"] = info.envd_access_token
    out.update({
        "domain": domain,
        "allowInternetAccess": info.network.allow_internet_access,
        "network": network(info.network),
        "lifecycle": {"autoResume": info.auto_resume,
                      "onTimeout": "pause" if info.auto_pause else "kill"},
    })
    if info.pause_mode:
        out["pauseMode"] = info.pause_mode
    return out


def snapshot(info: SnapshotInfo) -> dict[str, Any]:
    return {"snapshotID": info.snapshot_id, "names": list(info.names or (info.snapshot_id,))}


def fork_result(res: ForkResult, domain: str | None) -> dict[str, Any]:
    if res.sandbox is not None:
        return {"sandbox": sandbox(res.sandbox, domain)}
    status = res.error_status or 500
    return {"error": {"code": status, "message": res.error or "fork failed"}}


def metric(m: Metric) -> dict[str, Any]:
    return {
        "timestamp": rfc3339(m.timestamp),
        "timestampUnix": int(m.timestamp),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": float(m.cpu_used_pct),
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": m.mem_cache,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    }


def log_entry(line: LogLine) -> dict[str, Any]:
    """`SandboxLogEntry`."""
    level = line.level if line.level in ("debug", "info", "warn", "error") else "info"
    return {"timestamp": rfc3339(line.timestamp), "message": line.line, "level": level,
            "fields": {}}


def legacy_log(line: LogLine) -> dict[str, Any]:
    """`SandboxLog` (v1 logs)."""
    return {"timestamp": rfc3339(line.timestamp), "line": line.line}
