"""The OpenAPI 3 document served at /openapi.json (hand-written; field names as upstream).

It describes what this server accepts and returns, including every error response, so
that schemathesis can fuzz it (tests/api/test_openapi_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from .parse import INT32_MAX, MAX_FORKS, MAX_LIST_LIMIT

J = dict[str, Any]


def _ref(name: str) -> J:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: J) -> J:
    if "$ref" in schema:  # OpenAPI 3.0: siblings of $ref are ignored
        return {"nullable": True, "allOf": [schema]}
    return {**schema, "nullable": True}


def _obj(props: J, required: tuple[str, ...] = ()) -> J:
    """An object schema. Optional properties are nullable: the server reads null as absent."""
    props = {k: v if k in required else _nullable(v) for k, v in props.items()}
    out: J = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


_STR: J = {"type": "string"}
_BOOL: J = {"type": "boolean"}
_INT32: J = {"type": "integer", "format": "int32", "minimum": 0, "maximum": INT32_MAX}
_INT64: J = {"type": "integer", "format": "int64"}
INT64_MAX = 2**63 - 1
_TIME: J = {"type": "string", "format": "date-time"}
_STR_MAP: J = {"type": "object", "additionalProperties": _STR}
_STR_LIST: J = {"type": "array", "items": _STR}
_NULL_STR: J = {"type": "string", "nullable": True}


def _schemas() -> J:
    network_update = {
        "allowOut": _STR_LIST, "denyOut": _STR_LIST, "dnsServers": _STR_LIST,
        "egressProxy": {"type": "object", "nullable": True},
        "rules": {"type": "object"},
        "allow_internet_access": _BOOL,
    }
    network = {**{k: v for k, v in network_update.items() if k != "allow_internet_access"},
               "allowPublicTraffic": {"type": "boolean", "nullable": True},
               "maskRequestHost": _STR,
               "httpsPorts": {"type": "array", "items": {"type": "integer"}}}
    new_v2 = {
        "templateID": {"type": "string", "minLength": 1},
        "timeout": {**_INT32, "default": 300},
        "autoPause": _BOOL,
        "autoPauseMemory": _BOOL,
        "autoResume": _ref("SandboxAutoResumeConfig"),
        "allow_internet_access": _BOOL,
        "network": _ref("SandboxNetworkConfig"),
        "metadata": _STR_MAP,
        "envVars": _STR_MAP,
        "mcp": {"type": "object", "nullable": True},
        "iam": {"type": "object"},
        "volumeMounts": {"type": "array", "maxItems": 0, "items": _ref("SandboxVolumeMount"),
                         "description": "not supported: must be empty"},
    }
    listed = {
        "templateID": _STR, "sandboxID": _STR, "clientID": _STR, "alias": _STR,
        "startedAt": _TIME, "endAt": _TIME,
        "cpuCount": {"type": "integer", "minimum": 1},
        "memoryMB": {"type": "integer", "minimum": 128},
        "diskSizeMB": {"type": "integer", "minimum": 0},
        "state": {"type": "string", "enum": ["running", "paused"]},
        "envdVersion": _STR, "metadata": _STR_MAP,
        "volumeMounts": {"type": "array", "items": _ref("SandboxVolumeMount")},
        "envdUnresponsiveAtPause": _BOOL,
    }
    listed_req = ("templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount",
                  "memoryMB", "diskSizeMB", "state", "envdVersion")
    log_entry = _obj({"timestamp": _TIME, "message": _STR,
                      "level": {"type": "string", "enum": ["debug", "info", "warn", "error"]},
                      "fields": _STR_MAP}, ("timestamp", "message", "level", "fields"))
    return {
        "Error": _obj({"code": {"type": "integer", "format": "int32"}, "message": _STR,
                       "error_code": _STR}, ("code", "message")),
        "SandboxAutoResumeConfig": _obj({"enabled": _BOOL}, ("enabled",)),
        "SandboxVolumeMount": _obj({"name": _STR, "path": _STR}, ("name", "path")),
        "SandboxNetworkConfig": _obj(network),
        "SandboxNetworkUpdateConfig": _obj(network_update),
        "NewSandboxV2": _obj(new_v2, ("templateID",)),
        "NewSandbox": _obj({**new_v2, "secure": _BOOL}, ("templateID",)),
        "Sandbox": _obj({"templateID": _STR, "sandboxID": _STR, "clientID": _STR,
                         "envdVersion": _STR, "alias": _STR, "envdAccessToken": _STR,
                         "trafficAccessToken": _NULL_STR, "domain": _NULL_STR},
                        ("templateID", "sandboxID", "clientID", "envdVersion")),
        "ListedSandbox": _obj(listed, listed_req),
        "SandboxDetail": _obj({
            **listed, "envdAccessToken": _STR, "domain": _NULL_STR,
            "allowInternetAccess": {"type": "boolean", "nullable": True},
            "network": _ref("SandboxNetworkConfig"),
            "lifecycle": _obj({"autoResume": _BOOL,
                               "onTimeout": {"type": "string", "enum": ["kill", "pause"]}},
                              ("autoResume", "onTimeout")),
            "pauseMode": {"type": "string", "enum": ["full", "filesystem"]},
        }, listed_req),
        "ConnectSandboxV2": _obj({"timeout": _INT32, "memory": _BOOL}),
        "ConnectSandbox": _obj({"timeout": _INT32, "memory": _BOOL}, ("timeout",)),
        "ResumedSandbox": _obj({"timeout": _INT32, "autoPause": _BOOL, "memory": _BOOL}),
        "SandboxTimeoutRequest": _obj({"timeout": _INT32}, ("timeout",)),
        "SandboxRefreshRequest": _obj({"duration": {"type": "integer", "minimum": 0,
                                                    "maximum": 3600}}),
        "SandboxPauseRequest": _obj({"memory": _BOOL, "requireHealthyGuest": _BOOL}),
        "SandboxSnapshotRequest": _obj({"name": _STR, "memory": _BOOL}),
        "SnapshotInfo": _obj({"snapshotID": _STR, "names": _STR_LIST}, ("snapshotID", "names")),
        "SandboxForkRequest": _obj({"timeout": _INT32,
                                    "count": {"type": "integer", "minimum": 1,
                                              "maximum": MAX_FORKS, "default": 1}}),
        "SandboxForkResult": _obj({"sandbox": _ref("Sandbox"), "error": _ref("Error")}),
        "SandboxMetric": _obj({
            "timestamp": _TIME, "timestampUnix": _INT64, "cpuCount": {"type": "integer"},
            "cpuUsedPct": {"type": "number"}, "memUsed": _INT64, "memTotal": _INT64,
            "memCache": _INT64, "diskUsed": _INT64, "diskTotal": _INT64,
        }, ("timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
            "memCache", "diskUsed", "diskTotal")),
        "SandboxLog": _obj({"timestamp": _TIME, "line": _STR}, ("timestamp", "line")),
        "SandboxLogEntry": log_entry,
        "SandboxLogs": _obj({"logs": {"type": "array", "items": _ref("SandboxLog")},
                             "logEntries": {"type": "array", "items": _ref("SandboxLogEntry")}},
                            ("logs", "logEntries")),
        "SandboxLogsV2Response": _obj({"logs": {"type": "array",
                                                "items": _ref("SandboxLogEntry")}}, ("logs",)),
    }


_ERROR_TEXT = {400: "Bad request", 401: "Authentication error", 404: "Not found",
               409: "Conflict", 500: "Server error"}


def _errors(*codes: int) -> J:
    content = {"application/json": {"schema": _ref("Error")}}
    return {str(c): {"description": _ERROR_TEXT[c], "content": content} for c in codes}


def _json(schema: J, description: str = "OK", headers: J | None = None) -> J:
    out: J = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        out["headers"] = headers
    return out


def _body(name: str, required: bool = True) -> J:
    return {"required": required,
            "content": {"application/json": {"schema": _ref(name)}}}


_NO_CONTENT: J = {"description": "No content"}
_SID: J = {"name": "sandboxID", "in": "path", "required": True, "schema": _STR}
_NEXT: J = {"X-Next-Token": {"description": "cursor of the next page (absent on the last)",
                             "schema": _STR}}


def arr(name: str) -> J:
    return {"type": "array", "items": _ref(name)}


def _q(name: str, schema: J) -> J:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _op(op_id: str, responses: J, *, params: list[J] | None = None, body: J | None = None,
        errors: tuple[int, ...] = (400, 401, 404, 500)) -> J:
    out: J = {"operationId": op_id, "responses": {**responses, **_errors(*errors)}}
    if params:
        out["parameters"] = params
    if body:
        out["requestBody"] = body
    return out


def _paths() -> J:
    limit = _q("limit", {"type": "integer", "format": "int32", "minimum": 1,
                         "maximum": MAX_LIST_LIMIT, "default": MAX_LIST_LIMIT})
    list_v2_params = [
        _q("metadata", _STR), _q("state", {"type": "array", "items": {
            "type": "string", "enum": ["running", "paused"]}}),
        _q("order", {"type": "string", "enum": ["asc", "desc"]}),
        _q("startedAfter", _TIME), _q("template", _STR), limit, _q("nextToken", _STR),
    ]
    list_v2_params[1]["style"] = "form"
    list_v2_params[1]["explode"] = False
    sandbox = _ref("Sandbox")
    unix = {"type": "integer", "format": "int64", "minimum": 0, "maximum": INT64_MAX}
    return {
        "/health": {"get": {"operationId": "health", "security": [],
                            "responses": {"200": _json({"type": "object"})}}},
        "/v2/sandboxes": {
            "post": _op("createSandboxV2", {"201": _json(sandbox, "The sandbox was created")},
                        body=_body("NewSandboxV2"),
                        params=[{"name": "Idempotency-Key", "in": "header", "required": False,
                                 "schema": {"type": "string",
                                            "pattern": "^[\\x21-\\x7e]{1,255}$"}}],
                        errors=(400, 401, 404, 409, 500)),
            "get": _op("listSandboxesV2", {"200": _json(arr("ListedSandbox"), headers=_NEXT)},
                       params=list_v2_params, errors=(400, 401, 500)),
        },
        "/sandboxes": {
            "post": _op("createSandbox", {"201": _json(sandbox, "The sandbox was created")},
                        body=_body("NewSandbox"), errors=(400, 401, 404, 409, 500)),
            "get": _op("listSandboxes", {"200": _json(arr("ListedSandbox"))},
                       params=[_q("metadata", _STR)], errors=(400, 401, 500)),
        },
        "/sandboxes/{sandboxID}": {
            "get": _op("getSandbox", {"200": _json(_ref("SandboxDetail"))}, params=[_SID]),
            "delete": _op("killSandbox", {"204": _NO_CONTENT}, params=[_SID]),
        },
        "/v2/sandboxes/{sandboxID}/connect": {"post": _op(
            "connectSandboxV2", {"200": _json(sandbox, "Already running"),
                                 "201": _json(sandbox, "Resumed")},
            params=[_SID], body=_body("ConnectSandboxV2", False),
            errors=(400, 401, 404, 409, 500))},
        "/sandboxes/{sandboxID}/connect": {"post": _op(
            "connectSandbox", {"200": _json(sandbox, "Already running"),
                               "201": _json(sandbox, "Resumed")},
            params=[_SID], body=_body("ConnectSandbox"), errors=(400, 401, 404, 409, 500))},
        "/sandboxes/{sandboxID}/pause": {"post": _op(
            "pauseSandbox", {"204": _NO_CONTENT}, params=[_SID],
            body=_body("SandboxPauseRequest", False), errors=(400, 401, 404, 409, 500))},
        "/sandboxes/{sandboxID}/resume": {"post": _op(
            "resumeSandbox", {"201": _json(sandbox, "Resumed")}, params=[_SID],
            body=_body("ResumedSandbox", False), errors=(400, 401, 404, 409, 500))},
        "/sandboxes/{sandboxID}/timeout": {"post": _op(
            "setSandboxTimeout", {"204": _NO_CONTENT}, params=[_SID],
            body=_body("SandboxTimeoutRequest"))},
        "/sandboxes/{sandboxID}/refreshes": {"post": _op(
            "refreshSandbox", {"204": _NO_CONTENT}, params=[_SID],
            body=_body("SandboxRefreshRequest", False))},
        "/sandboxes/{sandboxID}/fork": {"post": _op(
            "forkSandbox", {"201": _json(arr("SandboxForkResult"), "Forks (one entry each)")},
            params=[_SID], body=_body("SandboxForkRequest", False),
            errors=(400, 401, 404, 409, 500))},
        "/sandboxes/{sandboxID}/network": {"put": _op(
            "updateSandboxNetwork", {"204": _NO_CONTENT}, params=[_SID],
            body=_body("SandboxNetworkUpdateConfig"))},
        "/sandboxes/{sandboxID}/metrics": {"get": _op(
            "getSandboxMetrics", {"200": _json(arr("SandboxMetric"))},
            params=[_SID, _q("start", unix), _q("end", unix)])},
        "/sandboxes/{sandboxID}/logs": {"get": _op(
            "getSandboxLogs", {"200": _json(_ref("SandboxLogs"))},
            params=[_SID, _q("start", unix),
                    _q("limit", {"type": "integer", "minimum": 0, "maximum": 10000})])},
        "/v2/sandboxes/{sandboxID}/logs": {"get": _op(
            "getSandboxLogsV2", {"200": _json(_ref("SandboxLogsV2Response"))},
            params=[_SID, _q("cursor", unix),
                    _q("limit", {"type": "integer", "minimum": 0, "maximum": 1000}),
                    _q("direction", {"type": "string", "enum": ["forward", "backward"]}),
                    _q("level", {"type": "string", "enum": ["debug", "info", "warn", "error"]}),
                    _q("search", _STR)])},
        "/sandboxes/{sandboxID}/snapshots": {"post": _op(
            "createSnapshot", {"201": _json(_ref("SnapshotInfo"), "Snapshot created")},
            params=[_SID], body=_body("SandboxSnapshotRequest", False),
            errors=(400, 401, 404, 409, 500))},
        "/snapshots": {"get": _op(
            "listSnapshots", {"200": _json(arr("SnapshotInfo"), headers=_NEXT)},
            params=[_q("sandboxID", _STR), _q("name", _STR), limit, _q("nextToken", _STR)],
            errors=(400, 401, 500))},
        "/templates/{templateID}": {"delete": _op(
            "deleteTemplate", {"204": _NO_CONTENT},
            params=[{"name": "templateID", "in": "path", "required": True, "schema": _STR,
                     "description": "percent-encoded; may contain '/' and ':'"}])},
    }


def document() -> J:
    return {
        "openapi": "3.0.3",
        "info": {"title": "aenv E2B-compatible API", "version": "1.0.0"},
        "components": {
            "securitySchemes": {"ApiKeyAuth": {"type": "apiKey", "in": "header",
                                               "name": "X-API-Key"}},
            "schemas": _schemas(),
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": _paths(),
    }
