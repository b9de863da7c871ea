"""Wire models of the template build API (docs/e2b-template-api.md), spelled as the e2b
SDKs' generated clients send and parse them. Pure data, like models.py."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from .models import MAX_LIST_LIMIT, Limit, LogLevel, QueryModel, RequestModel, WireModel
from .types import INT32_MAX, Between, Count64, Cursor, Nullable

BuildStatusName = Literal["building", "waiting", "ready", "error"]
Int32 = Annotated[int, Between(0, INT32_MAX, "int32")]
Int64 = Annotated[int, Field(json_schema_extra={"format": "int64"})]


# --- request bodies -------------------------------------------------------------------

class TemplateBuildRequestV3(RequestModel):
    name: str | None = Field(default=None, max_length=128,
                             description="[namespace/]alias[:tag]; required")
    tags: Nullable[list[str]] = Field(default_factory=list, description="more tags")
    cpu_count: Annotated[int, Between(1, INT32_MAX, "int32")] | None = Field(
        default=None, alias="cpuCount")
    memory_mb: Annotated[int, Between(128, INT32_MAX, "int32")] | None = Field(
        default=None, alias="memoryMB")
    min_free_disk_mb: Int32 | None = Field(default=None, alias="minFreeDiskMb",
                                           description="best effort: added to the disk")
    alias: str | None = Field(default=None, description="deprecated: the name when absent")
    team_id: str | None = Field(default=None, alias="teamID", description="deprecated, ignored")


class TemplateStep(RequestModel):
    type: str = Field(min_length=1, description="RUN, COPY, ENV, WORKDIR, USER (ADD, ARG)")
    args: Nullable[list[str]] = Field(default_factory=list)
    files_hash: str | None = Field(default=None, alias="filesHash")
    force: Nullable[bool] = False


class GeneralRegistry(RequestModel):
    type: Literal["registry"]
    username: str = Field(min_length=1)
    password: str = Field(min_length=1)


class AwsRegistry(RequestModel):
    type: Literal["aws"]
    aws_access_key_id: str = Field(alias="awsAccessKeyId")
    aws_secret_access_key: str = Field(alias="awsSecretAccessKey")
    aws_region: str = Field(alias="awsRegion")


class GcpRegistry(RequestModel):
    type: Literal["gcp"]
    service_account_json: str = Field(alias="serviceAccountJson", min_length=1)


FromImageRegistry = Annotated[GeneralRegistry | AwsRegistry | GcpRegistry,
                              Field(discriminator="type")]


class TemplateBuildStartV2(RequestModel):
    """Exactly one of fromImage and fromTemplate."""

    from_image: str | None = Field(default=None, alias="fromImage")
    from_template: str | None = Field(default=None, alias="fromTemplate",
                                      description="template id or name[:tag]")
    from_image_registry: FromImageRegistry | None = Field(
        default=None, alias="fromImageRegistry", description="aws: not supported")
    force: Nullable[bool] = False
    steps: Nullable[list[TemplateStep]] = Field(default_factory=list)
    start_cmd: str | None = Field(default=None, alias="startCmd")
    ready_cmd: str | None = Field(default=None, alias="readyCmd")


class AssignTemplateTagsRequest(RequestModel):
    target: str = Field(min_length=1, description="name:tag of the build to tag")
    tags: list[str]


class DeleteTemplateTagsRequest(RequestModel):
    name: str = Field(min_length=1, description="a name without a tag")
    tags: list[str]


# --- query strings and headers --------------------------------------------------------

class BuildStatusQuery(QueryModel):
    logs_offset: Int32 = Field(default=0, alias="logsOffset",
                               description="index of the first log entry returned")
    limit: Annotated[int, Between(0, 100, "int32")] = 100
    level: LogLevel | None = Field(default=None, description="the lowest level returned")


class ListTemplatesQuery(QueryModel):
    blank_is_absent = frozenset({"teamID"})

    team_id: str | None = Field(default=None, alias="teamID",
                                description="accepted, ignored (one team per node)")


class ListTemplatesV2Query(ListTemplatesQuery):
    blank_is_absent = frozenset({"teamID", "nextToken"})

    limit: Limit = MAX_LIST_LIMIT
    next_token: Cursor | None = Field(default=None, alias="nextToken")


class TemplateBuildsQuery(QueryModel):
    blank_is_absent = frozenset({"nextToken"})

    limit: Limit = MAX_LIST_LIMIT
    next_token: Cursor | None = Field(default=None, alias="nextToken")


class UploadQuery(QueryModel):
    """The signed part of an upload URL (GET /templates/{id}/files/{hash} makes it)."""

    expires: Count64 = Field(description="unix seconds")
    signature: str = Field(pattern=r"^[0-9a-f]{64}$")


class BuildHeaders(WireModel):
    user_agent: str | None = Field(default=None, alias="User-Agent",
                                   description="an e2b SDK's version must parse")


# --- response bodies ------------------------------------------------------------------

class TemplateRequestResponseV3(WireModel):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool
    names: list[str]
    tags: list[str]
    aliases: list[str]


class TemplateBuildFileUpload(WireModel):
    present: bool
    url: str | None = Field(default=None, description="signed PUT URL, no API key needed")
    headers: dict[str, str] | None = None


class BuildLogEntry(WireModel):
    timestamp: datetime
    level: LogLevel
    message: str
    step: str | None = Field(default=None, description="base, 1..N, finalize")


class BuildStatusReason(WireModel):
    message: str
    step: str | None = None
    log_entries: list[BuildLogEntry] | None = Field(default=None, alias="logEntries")


class TemplateBuildInfo(WireModel):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: BuildStatusName
    logs: list[str] = Field(description="legacy: always empty")
    log_entries: list[BuildLogEntry] = Field(alias="logEntries")
    reason: BuildStatusReason | None = None


class TeamUser(WireModel):
    id: str = Field(json_schema_extra={"format": "uuid"})
    email: str | None


class Template(WireModel):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID", description="the newest build")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    public: bool
    aliases: list[str]
    names: list[str]
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    created_by: TeamUser | None = Field(alias="createdBy")
    last_spawned_at: datetime | None = Field(alias="lastSpawnedAt")
    spawn_count: Int64 = Field(alias="spawnCount")
    build_count: int = Field(alias="buildCount")
    envd_version: str = Field(alias="envdVersion")
    build_status: BuildStatusName = Field(alias="buildStatus")
    is_default: bool | None = Field(default=None, alias="isDefault")
    description: str | None = None


class TemplateBuild(WireModel):
    build_id: str = Field(alias="buildID", json_schema_extra={"format": "uuid"})
    status: BuildStatusName
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    finished_at: datetime | None = Field(default=None, alias="finishedAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int | None = Field(default=None, alias="diskSizeMB")
    envd_version: str | None = Field(default=None, alias="envdVersion")


class TemplateWithBuilds(Template):
    builds: list[TemplateBuild] = Field(description="newest first; paginated")


class TemplateAliasResponse(WireModel):
    template_id: str = Field(alias="templateID")
    public: bool


class AssignedTemplateTags(WireModel):
    build_id: str = Field(alias="buildID", json_schema_extra={"format": "uuid"})
    tags: list[str]


class TemplateTag(WireModel):
    tag: str
    build_id: str = Field(alias="buildID", json_schema_extra={"format": "uuid"})
    created_at: datetime = Field(alias="createdAt")
