"""The route table: every operation of the REST API in one place.

Each `Operation` names its path, method, handler, the models it reads (body, query,
headers) and its replies. The same table builds the starlette routes (whose dispatcher
validates exactly the declared models before calling the handler) and the OpenAPI document
(openapi.py), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import admin, cluster, uploads
from . import models as m
from . import sandboxes as sb
from . import snapshots as snap
from . import template_models as tm
from . import templates as tpl
from . import terminal_links as term
from . import volume_models as vm
from . import volumes as vol
from .errors import response_for
from .validation import read_body, read_headers, read_query

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[..., Awaitable[Response]]   # (request, *, body=, query=, headers=)


@dataclass(frozen=True)
class Reply:
    """One documented success answer: status, text, body type (a model or e.g.
    `list[Model]`; None: no body) and the response headers it may carry."""

    status: int
    description: str
    schema: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    method: str
    path: str                   # starlette syntax; parameters named as on the wire
    operation_id: str
    handler: Handler
    replies: tuple[Reply, ...]
    body: type[BaseModel] | None = None
    body_required: bool = True
    query: type[BaseModel] | None = None
    headers: type[BaseModel] | None = None
    errors: tuple[int, ...] = (400, 401, 404, 500)
    raw_body: str | None = None  # a non-JSON body the handler streams (its media type)


def dispatcher(op: Operation) -> Endpoint:
    """The endpoint of `op`: validate the declared models, call the handler with them, and
    turn every exception into an E2B error body."""

    async def endpoint(request: Request) -> Response:
        try:
            kwargs: dict[str, Any] = {}
            if op.headers is not None:
                kwargs["headers"] = read_headers(request, op.headers)
            if op.query is not None:
                kwargs["query"] = read_query(request, op.query)
            if op.body is not None:
                kwargs["body"] = await read_body(request, op.body, required=op.body_required)
            return await op.handler(request, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the edge: map everything, cancel passes
            return response_for(exc)

    return endpoint


def _by_method(handlers: dict[str, Endpoint]) -> tuple[Endpoint, list[str]]:
    """One endpoint per path, so that a 405 lists every allowed method in `Allow`."""
    if "GET" in handlers:
        handlers = {**handlers, "HEAD": handlers["GET"]}

    async def endpoint(request: Request) -> Response:
        return await handlers[request.method](request)

    return endpoint, list(handlers)


def starlette_routes(operations: Iterable[Operation]) -> list[Route]:
    by_path: dict[str, dict[str, Endpoint]] = {}
    for op in operations:
        by_path.setdefault(op.path, {})[op.method] = dispatcher(op)
    out = []
    for path, handlers in by_path.items():
        endpoint, methods = _by_method(handlers)
        out.append(Route(path, endpoint, methods=methods))
    return out


# --- the table ------------------------------------------------------------------------

async def health(request: Request, *, query: m.HealthQuery) -> Response:
    reasons = [] if query.probe == "live" else sb.orch(request).health()
    if reasons:
        return sb.reply(m.Health(status="unhealthy", reasons=reasons), 503)
    return sb.reply(m.Health(status="ok"))


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


SID = "/sandboxes/{sandboxID}"
VID = "/volumes/{volumeID}"
VC = "/volumecontent/{volumeID}"
TID = "/templates/{templateID:path}"
NO_CONTENT = (Reply(204, "No content"),)
NEXT_TOKEN = {"X-Next-Token": "cursor of the next page (absent on the last)"}
CONNECTED = (Reply(200, "Already running", m.Sandbox), Reply(201, "Resumed", m.Sandbox))
_409 = (400, 401, 404, 409, 500)
# operations that read an answer from the sandbox's envd (its /init, /metrics): 502 when
# envd answers past its limit (host/guestio.py)
_ENVD = (*_409, 502)


def _op(method: str, path: str, operation_id: str, handler: Handler,
        *replies: Reply, **kwargs: Any) -> Operation:
    return Operation(method, path, operation_id, handler, replies, **kwargs)


OPERATIONS: tuple[Operation, ...] = (
    _op("GET", "/health", "health", health, Reply(200, "OK", m.Health),
        Reply(503, "The node takes no new sandboxes now (its disk under the floor)", m.Health),
        query=m.HealthQuery, errors=(400,)),
    _op("POST", "/admin/gc", "collectGarbage", admin.collect,
        Reply(200, "What the node's collector removed, or would remove with dryRun (aenv "
                   "extension)", admin.GcReport), query=admin.GcQuery, errors=(400, 401, 500)),
    _op("GET", "/openapi.json", "openapi", openapi, Reply(200, "This document", dict[str, Any]),
        errors=(401,)),
    _op("POST", "/v2/sandboxes", "createSandboxV2", sb.create_v2,
        Reply(201, "The sandbox was created", m.Sandbox),
        body=m.NewSandboxV2, headers=m.CreateHeaders, errors=_ENVD),
    _op("GET", "/v2/sandboxes", "listSandboxesV2", sb.list_v2,
        Reply(200, "OK", list[m.ListedSandbox], NEXT_TOKEN),
        query=m.ListSandboxesQuery, errors=(400, 401, 500)),
    _op("POST", "/sandboxes", "createSandbox", sb.create_v1,
        Reply(201, "The sandbox was created", m.Sandbox), body=m.NewSandbox, errors=_ENVD),
    _op("GET", "/sandboxes", "listSandboxes", sb.list_v1, Reply(200, "OK", list[m.ListedSandbox]),
        query=m.ListSandboxesV1Query, errors=(400, 401, 500)),
    _op("GET", SID, "getSandbox", sb.get_one, Reply(200, "OK", m.SandboxDetail)),
    _op("DELETE", SID, "killSandbox", sb.kill, *NO_CONTENT),
    _op("POST", f"/v2{SID}/connect", "connectSandboxV2", sb.connect_v2, *CONNECTED,
        body=m.ConnectSandboxV2, body_required=False, errors=_ENVD),
    _op("POST", f"{SID}/connect", "connectSandbox", sb.connect_v1, *CONNECTED,
        body=m.ConnectSandbox, errors=_ENVD),
    _op("POST", f"{SID}/pause", "pauseSandbox", sb.pause, *NO_CONTENT,
        body=m.SandboxPauseRequest, body_required=False, errors=(*_409, 503)),
    _op("POST", f"{SID}/resume", "resumeSandbox", sb.resume_v1, Reply(201, "Resumed", m.Sandbox),
        body=m.ResumedSandbox, body_required=False, errors=_ENVD),
    _op("POST", f"/cluster{SID}/adopt", "adoptSandbox", cluster.adopt,
        Reply(201, "This node holds the paused sandbox now (aenv cluster extension)",
              m.SandboxDetail), errors=(400, 401, 403, 404, 500)),
    # /cluster/*: the node key only; a client's API key gets 403 (host/api/auth.py)
    _op("DELETE", f"/cluster{SID}", "forgetSandbox", cluster.forget, *NO_CONTENT,
        errors=(*_409, 403)),
    _op("POST", "/cluster/signer", "findUrlSigner", cluster.signer,
        Reply(200, "The sandbox of this node that signed a /files URL (aenv cluster "
                   "extension)", cluster.Signer), body=cluster.SignedFiles,
        errors=(400, 401, 403, 404, 500)),
    _op("POST", f"{SID}/terminal", "createTerminalLink", term.create_link,
        Reply(201, "A signed link to the sandbox's web terminal (aenv extension)",
              term.TerminalLink), body=term.TerminalLinkRequest, body_required=False),
    _op("POST", f"{SID}/timeout", "setSandboxTimeout", sb.set_timeout, *NO_CONTENT,
        body=m.SandboxTimeoutRequest),
    _op("POST", f"{SID}/refreshes", "refreshSandbox", sb.refresh, *NO_CONTENT,
        body=m.SandboxRefreshRequest, body_required=False),
    _op("POST", f"{SID}/fork", "forkSandbox", sb.fork,
        Reply(201, "Forks (one entry each)", list[m.SandboxForkResult]),
        body=m.SandboxForkRequest, body_required=False, errors=_ENVD),
    _op("PUT", f"{SID}/network", "updateSandboxNetwork", sb.update_network, *NO_CONTENT,
        body=m.SandboxNetworkUpdateConfig),
    _op("GET", f"{SID}/metrics", "getSandboxMetrics", sb.metrics,
        Reply(200, "OK", list[m.SandboxMetric]), query=m.MetricsQuery,
        errors=(400, 401, 404, 500, 502)),
    _op("GET", f"{SID}/logs", "getSandboxLogs", sb.logs_v1, Reply(200, "OK", m.SandboxLogs),
        query=m.LogsQuery),
    _op("GET", f"/v2{SID}/logs", "getSandboxLogsV2", sb.logs_v2,
        Reply(200, "OK", m.SandboxLogsV2Response), query=m.LogsV2Query),
    _op("POST", f"{SID}/snapshots", "createSnapshot", snap.create,
        Reply(201, "Snapshot created", m.SnapshotInfo),
        body=m.SandboxSnapshotRequest, body_required=False, errors=_409),
    _op("GET", "/snapshots", "listSnapshots", snap.list_all,
        Reply(200, "OK", list[m.SnapshotInfo], NEXT_TOKEN),
        query=m.ListSnapshotsQuery, errors=(400, 401, 500)),
    # --- volumes (E2B's spec/openapi.yml) and their files (spec/openapi-volumecontent.yml:
    # the volume's Bearer token, not the API key; 401 without a valid one)
    _op("POST", "/volumes", "createVolume", vol.create,
        Reply(201, "The volume, and a token for its content", vm.VolumeAndToken),
        body=vm.NewVolume, errors=(400, 401, 500)),
    _op("GET", "/volumes", "listVolumes", vol.list_all, Reply(200, "OK", list[vm.Volume]),
        errors=(401, 500)),
    _op("GET", VID, "getVolume", vol.get_one, Reply(200, "OK", vm.VolumeAndToken)),
    _op("DELETE", VID, "deleteVolume", vol.destroy, *NO_CONTENT),
    _op("GET", f"{VC}/path", "getVolumeEntry", vol.stat,
        Reply(200, "OK", vm.VolumeEntryStat), query=vm.PathQuery),
    _op("PATCH", f"{VC}/path", "setVolumeEntryMetadata", vol.set_metadata,
        Reply(200, "OK", vm.VolumeEntryStat), query=vm.PathQuery, body=vm.VolumeMetadata),
    _op("DELETE", f"{VC}/path", "deleteVolumeEntry", vol.remove, *NO_CONTENT,
        query=vm.PathQuery),
    _op("GET", f"{VC}/dir", "listVolumeDir", vol.list_dir,
        Reply(200, "Entries, depth-first in name order", list[vm.VolumeEntryStat]),
        query=vm.DirQuery),
    _op("POST", f"{VC}/dir", "makeVolumeDir", vol.make_dir,
        Reply(201, "Made", vm.VolumeEntryStat), query=vm.CreateQuery, errors=_409),
    _op("GET", f"{VC}/file", "readVolumeFile", vol.read_file,
        Reply(200, "The file's bytes (application/octet-stream)"), query=vm.PathQuery),
    _op("PUT", f"{VC}/file", "writeVolumeFile", vol.write_file,
        Reply(201, "Written", vm.VolumeEntryStat), query=vm.CreateQuery,
        raw_body="application/octet-stream", errors=(*_409, 507)),
    # --- templates (docs/e2b-template-api.md). `path` convertor: ids like aenv/app:v1
    # arrive as aenv%2Fapp%3Av1, decoded before routing; the catch-all
    # /templates/{templateID} routes come last so that the longer paths match first.
    _op("GET", "/templates/aliases/{alias:path}", "getTemplateByAlias", tpl.alias,
        Reply(200, "OK", tm.TemplateAliasResponse), errors=(400, 401, 403, 404, 500)),
    _op("POST", "/v3/templates", "requestTemplateBuildV3", tpl.request_build,
        Reply(202, "The build was requested", tm.TemplateRequestResponseV3),
        body=tm.TemplateBuildRequestV3, errors=(400, 401, 403, 409, 500)),
    _op("GET", f"{TID}/files/{{hash}}", "getTemplateFileUpload", tpl.file_upload_link,
        Reply(201, "Whether the archive is here, and where to PUT it",
              tm.TemplateBuildFileUpload)),
    _op("PUT", uploads.UPLOAD_PATH, "uploadTemplateFile", uploads.upload,
        Reply(200, "Stored"), query=tm.UploadQuery, raw_body="application/octet-stream",
        errors=(400, 403, 413, 500)),
    _op("POST", f"/v2{TID}/builds/{{buildID}}", "startTemplateBuildV2", tpl.start_build,
        Reply(202, "The build started"), body=tm.TemplateBuildStartV2,
        headers=tm.BuildHeaders),
    _op("GET", f"{TID}/builds/{{buildID}}/status", "getTemplateBuildStatus", tpl.build_status,
        Reply(200, "OK", tm.TemplateBuildInfo), query=tm.BuildStatusQuery),
    _op("GET", f"{TID}/tags", "listTemplateTags", tpl.list_tags,
        Reply(200, "OK", list[tm.TemplateTag])),
    _op("POST", "/templates/tags", "assignTemplateTags", tpl.assign_tags,
        Reply(201, "Assigned", tm.AssignedTemplateTags), body=tm.AssignTemplateTagsRequest,
        errors=(400, 401, 403, 404, 500)),
    _op("DELETE", "/templates/tags", "deleteTemplateTags", tpl.remove_tags, *NO_CONTENT,
        body=tm.DeleteTemplateTagsRequest, errors=(400, 401, 403, 404, 500)),
    _op("GET", "/templates", "listTemplates", tpl.list_v1, Reply(200, "OK", list[tm.Template]),
        query=tm.ListTemplatesQuery, errors=(400, 401, 500)),
    _op("GET", "/v2/templates", "listTemplatesV2", tpl.list_v2,
        Reply(200, "OK", list[tm.Template], NEXT_TOKEN), query=tm.ListTemplatesV2Query,
        errors=(400, 401, 500)),
    _op("GET", TID, "getTemplate", tpl.get_one,
        Reply(200, "OK, builds newest first", tm.TemplateWithBuilds, NEXT_TOKEN),
        query=tm.TemplateBuildsQuery),
    # a built template, else a named snapshot (Sandbox.delete_snapshot)
    _op("DELETE", TID, "deleteTemplate", tpl.delete, *NO_CONTENT),
)
