"""The one mapping between the wire models (models.py) and the orchestrator's frozen values
(host/orchestrator/model.py, host/contract.py), in both directions.

Nothing below the API sees a pydantic model: requests leave here as `CreateRequest`,
`ListFilter` and `NetworkConfig`; answers come back as `SandboxInfo` & co. and leave as models.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from host.contract import BuildStep, NetworkConfig, RegistryAuth
from host.orchestrator import SandboxState
from host.orchestrator.model import (
    BuildInfo,
    BuildLogLine,
    BuildStart,
    BuildStatus,
    CreateRequest,
    ForkResult,
    ListFilter,
    LogLine,
    Metric,
    RequestedBuild,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    TemplateTag,
)

from . import models as m
from . import template_models as tm
from .errors import ApiError

# --- requests -------------------------------------------------------------------------

# NetworkConfig fields; every other member of a network body is kept in `extra`
_ENFORCED = frozenset({"allowPublicTraffic", "allowOut", "denyOut", "maskRequestHost",
                       "allow_internet_access"})
_INGRESS = frozenset({"allowPublicTraffic", "maskRequestHost", "httpsPorts"})


def _kept(body: m.RequestModel) -> dict[str, Any]:
    """Members accepted and kept, not enforced (including unknown ones), as sent."""
    return {k: v for k, v in body.wire().items() if k not in _ENFORCED}


def _deny(deny_out: Iterable[str], allow_internet_access: bool) -> tuple[str, ...]:
    deny = tuple(deny_out)
    if not allow_internet_access and "0.0.0.0/0" not in deny:
        deny = (*deny, "0.0.0.0/0")  # spec: allow_internet_access=false == denyOut 0.0.0.0/0
    return deny


def network(body: m.SandboxNetworkConfig | None, *, allow_internet_access: bool) -> NetworkConfig:
    """`SandboxNetworkConfig` of a create."""
    body = body or m.SandboxNetworkConfig()
    return NetworkConfig(
        allow_internet_access=allow_internet_access,
        allow_public_traffic=body.allow_public_traffic,
        allow_out=tuple(body.allow_out),
        deny_out=_deny(body.deny_out, allow_internet_access),
        mask_request_host=body.mask_request_host or None,
        extra=_kept(body),
    )


def updated_network(body: m.SandboxNetworkUpdateConfig, current: NetworkConfig) -> NetworkConfig:
    """PUT network replaces the egress config only; ingress settings (public traffic, host
    mask, httpsPorts) stay as they were."""
    extra = {k: v for k, v in _kept(body).items() if k not in _INGRESS}
    extra.update((k, v) for k, v in current.extra.items() if k in _INGRESS)
    return NetworkConfig(
        allow_internet_access=body.allow_internet_access,
        allow_public_traffic=current.allow_public_traffic,
        allow_out=tuple(body.allow_out),
        deny_out=_deny(body.deny_out, body.allow_internet_access),
        mask_request_host=current.mask_request_host,
        extra=extra,
    )


def create_request(body: m.NewSandboxV2, *, idempotency_key: str | None = None) -> CreateRequest:
    """`NewSandboxV2` (or legacy `NewSandbox`, secured only when asked) -> CreateRequest."""
    kwargs: dict[str, Any] = {}
    if body.auto_pause is not None:
        kwargs["auto_pause"] = body.auto_pause
    if body.auto_pause_memory is not None:
        kwargs["auto_pause_memory"] = body.auto_pause_memory
    return CreateRequest(
        template_id=body.template_id,
        timeout_s=body.timeout,
        auto_resume=body.auto_resume is not None and body.auto_resume.enabled,
        metadata=dict(body.metadata),
        env_vars=dict(body.env_vars),
        network=network(body.network, allow_internet_access=body.allow_internet_access),
        # v2 sandboxes are always secured; legacy v1 only when asked (1.x default: insecure)
        secure=body.secure if isinstance(body, m.NewSandbox) else True,
        idempotency_key=idempotency_key,
        volume_mounts=tuple((v.name, v.path) for v in body.volume_mounts),
        **kwargs,
    )


def states(public: Iterable[str] | None) -> frozenset[SandboxState] | None:
    """Public states (running, paused) -> the internal states that show as one of them."""
    wanted = set(public or ())
    if not wanted:
        return None
    gone = {SandboxState.KILLING, SandboxState.KILLED}
    return frozenset(s for s in SandboxState if s.public in wanted and s not in gone)


def list_filter(query: m.ListSandboxesQuery) -> ListFilter:
    # startedAfter is applied to the answer by started_since(), not here
    return ListFilter(states=states(query.state), metadata=query.metadata,
                      template=query.template)


def started_since(items: Iterable[SandboxInfo], after: datetime | None) -> list[SandboxInfo]:
    """The sandboxes started at or after `after`, compared as `startedAt` is answered (whole
    microseconds): a client passing back the startedAt it was given finds that sandbox,
    which comparing with the stored float (finer, either side of it) would not promise."""
    if after is None:
        return list(items)
    return [i for i in items if utc(i.started_at) >= after]


# --- answers --------------------------------------------------------------------------

def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def sandbox(info: SandboxInfo, domain: str | None, *, with_token: bool = True) -> m.Sandbox:
    """`Sandbox` (create / connect / fork)."""
    optional: dict[str, Any] = {}
    if info.alias:
        optional["alias"] = info.alias
    if with_token and info.envd_access_token:
        optional["envdAccessToken"] = info.envd_access_token
    return m.Sandbox(templateID=info.template_id, sandboxID=info.sandbox_id,
                     clientID=info.client_id, envdVersion=info.envd_version,
                     trafficAccessToken=info.traffic_access_token, domain=domain, **optional)


def network_answer(net: NetworkConfig) -> m.SandboxNetworkConfig:
    body: dict[str, Any] = {**net.extra, "allowPublicTraffic": net.allow_public_traffic,
                            "allowOut": list(net.allow_out), "denyOut": list(net.deny_out)}
    if net.mask_request_host:
        body["maskRequestHost"] = net.mask_request_host
    return m.SandboxNetworkConfig.model_validate(body)


def _listed_fields(info: SandboxInfo) -> dict[str, Any]:
    return {
        "templateID": info.template_id, "sandboxID": info.sandbox_id,
        "clientID": info.client_id, **({"alias": info.alias} if info.alias else {}),
        "startedAt": utc(info.started_at), "endAt": utc(info.end_at),
        "cpuCount": info.cpu_count, "memoryMB": info.memory_mb, "diskSizeMB": info.disk_mb,
        "state": info.state.public, "envdVersion": info.envd_version,
        "metadata": dict(info.metadata),
        "volumeMounts": [{"name": name, "path": path} for name, path in info.volume_mounts],
    }


def listed_sandbox(info: SandboxInfo) -> m.ListedSandbox:
    """`ListedSandbox` (list items)."""
    return m.ListedSandbox.model_validate(_listed_fields(info))


def sandbox_detail(info: SandboxInfo, domain: str | None) -> m.SandboxDetail:
    """`SandboxDetail` (GET one); carries the token and domain for JS 1.x `connect`."""
    body = _listed_fields(info)
    if info.envd_access_token:
        body["envdAccessToken"] = info.envd_access_token
    body.update({
        "domain": domain,
        "allowInternetAccess": info.network.allow_internet_access,
        "network": network_answer(info.network),
        "lifecycle": m.SandboxLifecycle(autoResume=info.auto_resume,
                                        onTimeout="pause" if info.auto_pause else "kill"),
    })
    if info.pause_mode:
        body["pauseMode"] = info.pause_mode
    return m.SandboxDetail.model_validate(body)


def snapshot(info: SnapshotInfo) -> m.SnapshotInfo:
    return m.SnapshotInfo(snapshotID=info.snapshot_id,
                          names=list(info.names or (info.snapshot_id,)))


def fork_result(res: ForkResult, domain: str | None) -> m.SandboxForkResult:
    if res.sandbox is not None:
        return m.SandboxForkResult(sandbox=sandbox(res.sandbox, domain))
    error = m.Error(code=res.error_status or 500, message=res.error or "fork failed")
    return m.SandboxForkResult(error=error)


def metric(x: Metric) -> m.SandboxMetric:
    return m.SandboxMetric(
        timestamp=utc(x.timestamp), timestampUnix=int(x.timestamp), cpuCount=x.cpu_count,
        cpuUsedPct=float(x.cpu_used_pct), memUsed=x.mem_used, memTotal=x.mem_total,
        memCache=x.mem_cache, diskUsed=x.disk_used, diskTotal=x.disk_total)


_LEVELS: dict[str, m.LogLevel] = {"debug": "debug", "info": "info", "warn": "warn",
                                  "error": "error"}


def log_entry(line: LogLine) -> m.SandboxLogEntry:
    """`SandboxLogEntry` (an unknown level shows as info)."""
    return m.SandboxLogEntry(timestamp=utc(line.timestamp), message=line.line,
                             level=_LEVELS.get(line.level, "info"), fields={})


def legacy_log(line: LogLine) -> m.SandboxLog:
    """`SandboxLog` (v1 logs)."""
    return m.SandboxLog(timestamp=utc(line.timestamp), line=line.line)


# --- templates (template_models.py) ---------------------------------------------------

def registry(body: tm.FromImageRegistry | None) -> RegistryAuth | None:
    """fromImageRegistry -> credentials for the pull. GCP's is a basic-auth login
    (`_json_key` + the key); AWS would need an ECR token exchange: not supported."""
    if body is None:
        return None
    if isinstance(body, tm.GeneralRegistry):
        return RegistryAuth(username=body.username, password=body.password)
    if isinstance(body, tm.GcpRegistry):
        return RegistryAuth(username="_json_key", password=body.service_account_json)
    raise ApiError(400, "'fromImageRegistry' of type 'aws' is not supported by this server")


def build_start(body: tm.TemplateBuildStartV2) -> BuildStart:
    return BuildStart(
        from_image=body.from_image, from_template=body.from_template,
        registry=registry(body.from_image_registry), force=body.force,
        steps=tuple(BuildStep(type=s.type, args=tuple(s.args), files_hash=s.files_hash,
                              force=s.force) for s in body.steps),
        start_cmd=body.start_cmd, ready_cmd=body.ready_cmd)


def requested_build(res: RequestedBuild) -> tm.TemplateRequestResponseV3:
    return tm.TemplateRequestResponseV3(
        templateID=res.template_id, buildID=res.build_id, public=res.public,
        names=list(res.names), tags=list(res.tags), aliases=list(res.aliases))


def _build_log(line: BuildLogLine) -> tm.BuildLogEntry:
    body: dict[str, Any] = {"timestamp": utc(line.timestamp),
                            "level": _LEVELS.get(line.level, "info"), "message": line.message}
    if line.step is not None:
        body["step"] = line.step
    return tm.BuildLogEntry.model_validate(body)


def build_status(st: BuildStatus) -> tm.TemplateBuildInfo:
    body: dict[str, Any] = {"templateID": st.template_id, "buildID": st.build_id,
                            "status": st.status, "logs": [],
                            "logEntries": [_build_log(e) for e in st.entries]}
    if st.reason:
        reason: dict[str, Any] = {"message": st.reason}
        if st.reason_step is not None:
            reason["step"] = st.reason_step
            reason["logEntries"] = [_build_log(e) for e in st.reason_entries]
        body["reason"] = reason
    return tm.TemplateBuildInfo.model_validate(body)


def _template_fields(t: TemplateInfo) -> dict[str, Any]:
    return {
        "templateID": t.template_id, "buildID": t.build.build_id, "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb, "diskSizeMB": t.disk_mb, "public": t.public,
        "aliases": list(t.aliases), "names": list(t.names), "createdAt": utc(t.created_at),
        "updatedAt": utc(t.updated_at), "createdBy": None,
        "lastSpawnedAt": utc(t.last_spawned_at) if t.last_spawned_at is not None else None,
        "spawnCount": t.spawn_count, "buildCount": t.build_count,
        "envdVersion": t.envd_version, "buildStatus": t.build.status,
    }


def template(t: TemplateInfo) -> tm.Template:
    return tm.Template.model_validate(_template_fields(t))


def template_build(b: BuildInfo) -> tm.TemplateBuild:
    body: dict[str, Any] = {"buildID": b.build_id, "status": b.status,
                            "createdAt": utc(b.created_at), "updatedAt": utc(b.updated_at),
                            "cpuCount": b.cpu_count, "memoryMB": b.memory_mb,
                            "diskSizeMB": b.disk_mb}
    if b.finished_at is not None:
        body["finishedAt"] = utc(b.finished_at)
    if b.envd_version:
        body["envdVersion"] = b.envd_version
    return tm.TemplateBuild.model_validate(body)


def template_with_builds(t: TemplateInfo, builds: Iterable[BuildInfo]) -> tm.TemplateWithBuilds:
    return tm.TemplateWithBuilds.model_validate(
        {**_template_fields(t), "builds": [template_build(b) for b in builds]})


def template_tag(t: TemplateTag) -> tm.TemplateTag:
    return tm.TemplateTag(tag=t.tag, buildID=t.build_id, createdAt=utc(t.created_at))
