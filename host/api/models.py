"""The REST API's wire format: one pydantic model per request body, query string, header
set and response body, named and spelled as in E2B's OpenAPI spec (docs: spec §3.3).

Pure data: no HTTP, no orchestrator. The route table (routes.py) says which model each
operation reads and answers with; validation.py validates requests against them, convert.py
maps them to and from the orchestrator's values, openapi.py documents them, and the CLI
parses the API's answers with them. Python names are snake_case; `alias` is the wire name.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .types import (
    Between,
    CommaList,
    Count64,
    Cursor,
    MetadataFilter,
    Nullable,
    Rfc3339,
    Seconds,
    wire_error,
)

MAX_FORKS = 16          # one node restores at most 16 children (DESIGN.md "Fork")
MAX_LIST_LIMIT = 100
MAX_DNS_SERVERS = 10    # as E2B
MASK_PORT = "${PORT}"   # in maskRequestHost: the sandbox port (the proxy fills it in)
_HOST_MASK = re.compile(r"^[A-Za-z0-9._-]+(?::([0-9]{1,5}))?$")

PublicState = Literal["running", "paused"]
LogLevel = Literal["debug", "info", "warn", "error"]


class WireModel(BaseModel):
    """A JSON object of the API: validated from and dumped to its wire spelling."""

    model_config = ConfigDict(serialize_by_alias=True)

    def wire(self) -> dict[str, Any]:
        """The JSON object, with exactly the members that were set."""
        return self.model_dump(mode="json", exclude_unset=True)


class RequestModel(WireModel):
    """A request body (or part of one). Null members are dropped before validation: null
    means absent, as the SDKs send it."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# --- request bodies -------------------------------------------------------------------

class SandboxAutoResumeConfig(RequestModel):
    enabled: bool


class SandboxVolumeMount(RequestModel):
    name: str
    path: str


class _EgressConfig(RequestModel):
    # Members not listed are accepted and kept (echoed in SandboxDetail), not enforced.
    # Listed ones this server cannot honour are refused (400 naming them), never ignored.
    model_config = ConfigDict(extra="allow")

    allow_out: Nullable[list[str]] = Field(
        default_factory=list, alias="allowOut",
        description="IPs / CIDR blocks; domain names are refused (not enforced here)")
    deny_out: Nullable[list[str]] = Field(default_factory=list, alias="denyOut",
                                          description="IPs / CIDR blocks")
    dns_servers: list[str] | None = Field(
        default=None, alias="dnsServers",
        description=f"up to {MAX_DNS_SERVERS} IPv4 addresses; they only open DNS for domain "
                    "allowOut entries, which are refused here: no effect (as in E2B)")
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy",
                                                description="not supported: absent or null")
    rules: dict[str, list[Any]] | None = Field(
        default=None, description="not supported: no domain may have a rule")

    @field_validator("allow_out", "deny_out")
    @classmethod
    def _addresses(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            try:
                ipaddress.ip_network(entry.strip(), strict=False)
            except ValueError:
                raise wire_error("takes IP addresses and CIDR blocks only (domain names are "
                                 "not supported by this server), got {entry}",
                                 entry=repr(entry)) from None
        return entries

    @field_validator("dns_servers")
    @classmethod
    def _dns_servers(cls, servers: list[str]) -> list[str]:
        if len(servers) > MAX_DNS_SERVERS:
            raise wire_error("must hold at most {most} entries, got {n}",
                             most=MAX_DNS_SERVERS, n=len(servers))
        for server in servers:
            try:
                ipaddress.IPv4Address(server)
            except ValueError:
                raise wire_error("must hold IPv4 addresses, got {server}",
                                 server=repr(server)) from None
        return servers

    @field_validator("egress_proxy")
    @classmethod
    def _egress_proxy(cls, proxy: dict[str, Any]) -> dict[str, Any]:
        raise wire_error("is not supported by this server (no SOCKS5 egress tunnel)")

    @field_validator("rules")
    @classmethod
    def _rules(cls, rules: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if any(rules.values()):
            raise wire_error("is not supported by this server (it does not transform "
                             "egress requests)")
        return rules


class SandboxNetworkConfig(_EgressConfig):
    allow_public_traffic: Nullable[bool] = Field(default=True, alias="allowPublicTraffic")
    mask_request_host: str | None = Field(
        default=None, alias="maskRequestHost",
        description="the Host user ports see (`${PORT}`: the port); the client's goes in "
                    "X-Forwarded-Host")
    https_ports: list[int] | None = Field(default=None, alias="httpsPorts",
                                          description="kept, not enforced")

    @field_validator("mask_request_host")
    @classmethod
    def _host_mask(cls, mask: str) -> str:
        if not mask:
            return mask   # as E2B: an empty mask is no mask
        if not mask.isascii():
            raise wire_error("must be ASCII, got {got}", got=repr(mask))
        found = _HOST_MASK.match(mask.replace(MASK_PORT, "1"))
        if found is None:
            raise wire_error("must be a host name with an optional :port ({placeholder} "
                             "stands for the port), got {got}", placeholder=MASK_PORT,
                             got=repr(mask))
        if found.group(1) and not 0 < int(found.group(1)) < 65536:
            raise wire_error("has an invalid port, got {got}", got=repr(mask))
        return mask


class SandboxNetworkUpdateConfig(_EgressConfig):
    """PUT network: replaces the egress config (omitted = cleared); ingress stays."""

    allow_internet_access: Nullable[bool] = Field(default=True,
                                                  description="false is denyOut 0.0.0.0/0")


class NewSandboxV2(RequestModel):
    template_id: str = Field(alias="templateID", min_length=1,
                             description="template id or alias, or a snapshot id")
    timeout: Nullable[Seconds] = Field(default=300,
                                       description="seconds until the sandbox expires")
    auto_pause: bool | None = Field(default=None, alias="autoPause",
                                    description="expiry pauses (true) or kills (false)")
    auto_pause_memory: bool | None = Field(default=None, alias="autoPauseMemory",
                                           description="false: that pause keeps the disk only")
    auto_resume: SandboxAutoResumeConfig | None = Field(default=None, alias="autoResume")
    allow_internet_access: Nullable[bool] = Field(default=True,
                                                  description="false is denyOut 0.0.0.0/0")
    network: SandboxNetworkConfig | None = None
    metadata: Nullable[dict[str, str]] = Field(default_factory=dict)
    env_vars: Nullable[dict[str, str]] = Field(default_factory=dict, alias="envVars")
    mcp: dict[str, Any] | None = Field(default=None, description="accepted, not used")
    iam: dict[str, Any] | None = Field(default=None, description="accepted, not used")
    volume_mounts: Nullable[list[SandboxVolumeMount]] = Field(
        default_factory=list, alias="volumeMounts",
        description="volumes (by name) mounted at absolute guest paths, at most 16")


class NewSandbox(NewSandboxV2):
    """Legacy create (SDKs <= 2.50, 1.x): the envd token only when `secure`."""

    secure: Nullable[bool] = False


class ConnectSandboxV2(RequestModel):
    timeout: Seconds | None = Field(default=None, description="absent: the TTL is left as is")
    memory: Nullable[bool] = Field(default=True,
                                   description="false: resume by a reboot of the disk")


class ConnectSandbox(RequestModel):
    timeout: Seconds
    memory: Nullable[bool] = True


class ResumedSandbox(RequestModel):
    timeout: Nullable[Seconds] = 15
    auto_pause: bool | None = Field(default=None, alias="autoPause",
                                    description="accepted, not used")
    memory: Nullable[bool] = True


class SandboxTimeoutRequest(RequestModel):
    timeout: Seconds


class SandboxRefreshRequest(RequestModel):
    duration: Nullable[Annotated[int, Between(0, 3600)]] = 0


class SandboxPauseRequest(RequestModel):
    memory: Nullable[bool] = Field(default=True, description="false: keep the filesystem only")
    require_healthy_guest: Nullable[bool] = Field(default=False, alias="requireHealthyGuest")


class SandboxSnapshotRequest(RequestModel):
    name: str | None = None
    memory: bool | None = Field(default=None, description="accepted, not used")


class SandboxForkRequest(RequestModel):
    timeout: Seconds | None = None
    count: Nullable[Annotated[int, Between(1, MAX_FORKS)]] = Field(
        default=1, description=f"at most {MAX_FORKS} forks per call on one node")


# --- query strings and headers (text: validated lax) ------------------------------------

class QueryModel(WireModel):
    """Query parameters. A blank value of a parameter in `blank_is_absent` (free-text ones)
    reads as absent; any other blank value is checked like the rest (and rejected)."""

    blank_is_absent: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_blanks(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v != "" or k not in cls.blank_is_absent}
        return data


Limit = Annotated[int, Between(1, MAX_LIST_LIMIT, "int32")]


class ListSandboxesQuery(QueryModel):
    blank_is_absent = frozenset({"metadata", "template", "nextToken"})

    metadata: MetadataFilter = Field(default_factory=dict)
    state: CommaList[PublicState] = Field(default=None, description="default: running and paused")
    order: Literal["asc", "desc"] = Field(default="desc", description="by startedAt")
    started_after: Rfc3339 | None = Field(default=None, alias="startedAfter")
    template: str | None = Field(default=None, description="template id or alias")
    limit: Limit = MAX_LIST_LIMIT
    next_token: Cursor | None = Field(default=None, alias="nextToken")


class ListSandboxesV1Query(QueryModel):
    blank_is_absent = frozenset({"metadata"})

    metadata: MetadataFilter = Field(default_factory=dict)


class ListSnapshotsQuery(QueryModel):
    blank_is_absent = frozenset({"sandboxID", "name", "nextToken"})

    sandbox_id: str | None = Field(default=None, alias="sandboxID")
    name: str | None = None
    limit: Limit = MAX_LIST_LIMIT
    next_token: Cursor | None = Field(default=None, alias="nextToken")


class MetricsQuery(QueryModel):
    start: Count64 = Field(default=0, description="unix seconds")
    end: Count64 | None = Field(default=None, description="unix seconds")


class LogsQuery(QueryModel):
    start: Count64 = Field(default=0, description="unix milliseconds")
    limit: Annotated[int, Between(0, 10_000)] = 1000


class LogsV2Query(QueryModel):
    cursor: Count64 = Field(default=0, description="unix milliseconds")
    limit: Annotated[int, Between(0, 1000)] = 1000
    direction: Literal["forward", "backward"] = "forward"
    level: LogLevel = Field(default="debug", description="the lowest level returned")
    search: str = ""


class CreateHeaders(WireModel):
    idempotency_key: str | None = Field(default=None, alias="Idempotency-Key",
                                        pattern=r"^[\x21-\x7e]{1,255}$")


# --- response bodies ------------------------------------------------------------------

class Error(WireModel):
    """Every non-2xx body; `code` equals the HTTP status."""

    code: int
    message: str
    error_code: str | None = None


class Health(WireModel):
    status: str
    # why a node takes no new sandboxes now (aenv extension; absent when healthy)
    reasons: list[str] | None = None


class HealthQuery(QueryModel):
    probe: Literal["ready", "live"] = Field(
        default="ready", description="live: 200 while the service answers (a liveness "
        "probe: a full disk is not cured by a restart); ready: 503 while the node should "
        "take no new sandboxes")


class Sandbox(WireModel):
    """Create / connect / fork."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    alias: str | None = None
    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    traffic_access_token: str | None = Field(default=None, alias="trafficAccessToken")
    domain: str | None = None


class ListedSandbox(WireModel):
    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    alias: str | None = None
    started_at: datetime = Field(alias="startedAt")
    end_at: datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount", ge=1)
    memory_mb: int = Field(alias="memoryMB", ge=1)
    disk_size_mb: int = Field(alias="diskSizeMB", ge=0)
    state: PublicState
    envd_version: str = Field(alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)
    volume_mounts: list[SandboxVolumeMount] = Field(default_factory=list, alias="volumeMounts")
    envd_unresponsive_at_pause: bool | None = Field(default=None, alias="envdUnresponsiveAtPause")


class SandboxLifecycle(WireModel):
    auto_resume: bool = Field(alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(alias="onTimeout")


class SandboxDetail(ListedSandbox):
    """GET one; carries the token and domain for JS 1.x `connect`."""

    envd_access_token: str | None = Field(default=None, alias="envdAccessToken")
    domain: str | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allowInternetAccess")
    network: SandboxNetworkConfig | None = None
    lifecycle: SandboxLifecycle | None = None
    pause_mode: Literal["full", "filesystem"] | None = Field(default=None, alias="pauseMode")


class SnapshotInfo(WireModel):
    snapshot_id: str = Field(alias="snapshotID")
    names: list[str]


class SandboxForkResult(WireModel):
    """One per fork: the child, or why it failed."""

    sandbox: Sandbox | None = None
    error: Error | None = None


class SandboxMetric(WireModel):
    timestamp: datetime
    timestamp_unix: int = Field(alias="timestampUnix", json_schema_extra={"format": "int64"})
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed", json_schema_extra={"format": "int64"})
    mem_total: int = Field(alias="memTotal", json_schema_extra={"format": "int64"})
    mem_cache: int = Field(alias="memCache", json_schema_extra={"format": "int64"})
    disk_used: int = Field(alias="diskUsed", json_schema_extra={"format": "int64"})
    disk_total: int = Field(alias="diskTotal", json_schema_extra={"format": "int64"})


class SandboxLog(WireModel):
    timestamp: datetime
    line: str


class SandboxLogEntry(WireModel):
    timestamp: datetime
    message: str
    level: LogLevel
    fields: dict[str, str]


class SandboxLogs(WireModel):
    """v1 logs: both spellings of every line."""

    logs: list[SandboxLog]
    log_entries: list[SandboxLogEntry] = Field(alias="logEntries")


class SandboxLogsV2Response(WireModel):
    logs: list[SandboxLogEntry]
