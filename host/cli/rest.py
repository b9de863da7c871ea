"""The REST API client of the CLI: plain httpx, one method per endpoint the CLI uses.

Answers are parsed with the API's own response models (host.api.models,
template_models and volume_models), so the CLI reads fields by name and a malformed answer is one error
line, not a KeyError. Template builds are not here: the e2b SDK runs them (builder.py).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from host.api import models as m
from host.api import template_models as tm
from host.api import volume_models as vm
from host.api.admin import GcReport

from .errors import ApiError, CliError, ConnectionFailed

T = TypeVar("T")

USER_AGENT = "aenv-cli/0.1"


class WebTerminal(BaseModel):
    """The answer of POST /sandboxes/{id}/terminal (an aenv extension): a signed link to
    the sandbox's web terminal and when it stops working."""

    url: str
    expires_at: datetime = Field(alias="expiresAt")


def error_message(resp: httpx.Response) -> str:
    """The server's `message` (E2B error body, envd/proxy JSON), else the raw text."""
    try:
        error = m.Error.model_validate_json(resp.content)
    except ValidationError:
        pass
    else:
        if error.message:
            return error.message
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            if isinstance(body.get(key), str) and body[key]:
                return str(body[key])
    text = resp.text.strip().splitlines()
    return text[0][:300] if text else resp.reason_phrase or "no message"


def raise_for_status(resp: httpx.Response, *, what: str = "API",
                     missing: str | None = None) -> None:
    """An error answer as ApiError; `missing`: what a 404 means (sandbox, snapshot,
    template), for the hint where to look."""
    if resp.status_code >= 400:
        if not resp.is_closed:
            resp.read()
        hint = NOT_FOUND_HINTS.get(missing or "", "") if resp.status_code == 404 else ""
        raise ApiError(resp.status_code, error_message(resp), what=what, hint=hint)


def parse(resp: httpx.Response, schema: type[T]) -> T:
    """The answer's body as `schema` (a model, or e.g. `list[Model]`)."""
    try:
        return TypeAdapter(schema).validate_json(resp.content)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise CliError(f"unexpected answer from {resp.request.method} {resp.request.url.path}: "
                       f"{where}: {err['msg']}") from exc


# what to do when a server does not answer, by which one it is
UNREACHABLE_HINTS = {
    "API": ": is the service running? (`make run`), or set --api-url / run `aenv auth login`",
    "sandbox proxy": ": is the service running? (`make run`), or set --sandbox-url "
                     "(env E2B_SANDBOX_URL) / run `aenv auth login`",
}
SLOW_HINT = ": the service did not answer in time; try again (the operation may have gone on)"
# what to do about a 404, by what was not found
NOT_FOUND_HINTS = {"sandbox": " (see `aenv ls`)", "snapshot": " (see `aenv snapshot ls`)",
                   "template": " (see `aenv template ls`)",
                   "volume": " (see `aenv volume ls`)"}
_ERRNO = re.compile(r"^\[Errno -?\d+\] ")


@contextlib.contextmanager
def transport_errors(url: str, what: str = "API") -> Iterator[None]:
    """httpx transport failures become one-line ConnectionFailed errors naming the server
    (`what`: "API" or "sandbox proxy") and what to do."""
    hint = UNREACHABLE_HINTS.get(what, "")
    try:
        yield
    except httpx.TimeoutException as exc:
        # no connection at all: as unreachable; connected but no answer: slow, not gone
        slow = not isinstance(exc, httpx.ConnectTimeout)
        raise ConnectionFailed(f"timed out talking to the {what} at {url} "
                               f"({type(exc).__name__})",
                               hint=SLOW_HINT if slow else hint) from exc
    except httpx.TransportError as exc:
        reason = _ERRNO.sub("", str(exc)) or type(exc).__name__
        raise ConnectionFailed(f"cannot reach the {what} at {url} ({reason})",
                               hint=hint) from exc


class ApiClient:
    """The E2B-compatible REST API at `api_url`, authenticated with `api_key`."""

    def __init__(self, api_url: str, api_key: str | None, *, timeout_s: float = 120.0) -> None:
        self.api_url = api_url.rstrip("/")
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["X-API-Key"] = api_key
        self._http = httpx.Client(base_url=self.api_url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)))

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict[str, str] | None = None,
                missing: str | None = None) -> httpx.Response:
        """One call; `missing`: what a 404 answer means (see raise_for_status)."""
        with transport_errors(self.api_url):
            resp = self._http.request(method, path, json=json_body, params=params)
        raise_for_status(resp, missing=missing)
        return resp

    def check_key(self) -> None:
        """Is the key accepted? The cheapest authenticated call: one sandbox listed."""
        self.request("GET", "/v2/sandboxes", params={"limit": "1"})

    # --- sandboxes ----------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> m.Sandbox:
        return parse(self.request("POST", "/v2/sandboxes", json_body=body), m.Sandbox)

    def list_sandboxes(self, state: str | None) -> list[m.ListedSandbox]:
        """Every page of GET /v2/sandboxes."""
        return self._all_pages("/v2/sandboxes", {"state": state} if state else {},
                               list[m.ListedSandbox])

    def _all_pages(self, path: str, params: dict[str, str], page: type[list[T]]) -> list[T]:
        """GET `path` page after page, following X-Next-Token until it is absent."""
        out: list[T] = []
        while True:
            resp = self.request("GET", path, params=params)
            out.extend(parse(resp, page))
            token = resp.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    def sandbox_call(self, method: str, sandbox_id: str, suffix: str = "", *,
                     v2: bool = False, json_body: Any = None) -> httpx.Response:
        """A call on /sandboxes/{id}[suffix] (a 404 says where to look for ids)."""
        path = f"{'/v2' if v2 else ''}/sandboxes/{_seg(sandbox_id)}{suffix}"
        return self.request(method, path, json_body=json_body, missing="sandbox")

    def get(self, sandbox_id: str) -> m.SandboxDetail:
        return parse(self.sandbox_call("GET", sandbox_id), m.SandboxDetail)

    def kill(self, sandbox_id: str) -> None:
        self.sandbox_call("DELETE", sandbox_id)

    def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        self.sandbox_call("POST", sandbox_id, "/pause",
                          json_body={} if memory else {"memory": False})

    def resume(self, sandbox_id: str, timeout_s: int | None, *,
               memory: bool = True) -> m.Sandbox:
        body: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        if not memory:
            body["memory"] = False
        return parse(self.sandbox_call("POST", sandbox_id, "/resume", json_body=body),
                     m.Sandbox)

    def connect(self, sandbox_id: str, timeout_s: int | None) -> tuple[m.Sandbox, bool]:
        """Resume if paused, else just return the sandbox (POST /v2/sandboxes/{id}/connect);
        and whether it was resumed (201; 200: it was running)."""
        body = {} if timeout_s is None else {"timeout": timeout_s}
        resp = self.sandbox_call("POST", sandbox_id, "/connect", v2=True, json_body=body)
        return parse(resp, m.Sandbox), resp.status_code == 201

    def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self.sandbox_call("POST", sandbox_id, "/timeout", json_body={"timeout": timeout_s})

    def fork(self, sandbox_id: str, count: int) -> list[m.SandboxForkResult]:
        resp = self.sandbox_call("POST", sandbox_id, "/fork", json_body={"count": count})
        return parse(resp, list[m.SandboxForkResult])

    def logs(self, sandbox_id: str) -> list[m.SandboxLogEntry]:
        resp = self.sandbox_call("GET", sandbox_id, "/logs", v2=True)
        return parse(resp, m.SandboxLogsV2Response).logs

    def metrics(self, sandbox_id: str) -> list[m.SandboxMetric]:
        return parse(self.sandbox_call("GET", sandbox_id, "/metrics"), list[m.SandboxMetric])

    def web_terminal(self, sandbox_id: str, ttl_s: int) -> WebTerminal:
        """A browser terminal URL for the sandbox, valid `ttl_s` seconds."""
        resp = self.sandbox_call("POST", sandbox_id, "/terminal", json_body={"ttl": ttl_s})
        return parse(resp, WebTerminal)

    # --- snapshots ----------------------------------------------------------------------

    def snapshot(self, sandbox_id: str, name: str | None) -> m.SnapshotInfo:
        body = {} if name is None else {"name": name}
        return parse(self.sandbox_call("POST", sandbox_id, "/snapshots", json_body=body),
                     m.SnapshotInfo)

    def snapshots(self, sandbox_id: str | None) -> list[m.SnapshotInfo]:
        return self._all_pages("/snapshots", {"sandboxID": sandbox_id} if sandbox_id else {},
                               list[m.SnapshotInfo])

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(snapshot_id)}", missing="snapshot")

    # --- volumes (their files: volumes.py's VolumeContent, with the volume's token) ------

    def create_volume(self, name: str) -> vm.VolumeAndToken:
        return parse(self.request("POST", "/volumes", json_body={"name": name}),
                     vm.VolumeAndToken)

    def volumes(self) -> list[vm.Volume]:
        return parse(self.request("GET", "/volumes"), list[vm.Volume])

    def volume(self, volume_id: str) -> vm.VolumeAndToken:
        """The volume and a fresh token for its content (`Authorization: Bearer`)."""
        return parse(self.request("GET", f"/volumes/{_seg(volume_id)}", missing="volume"),
                     vm.VolumeAndToken)

    def delete_volume(self, volume_id: str) -> None:
        self.request("DELETE", f"/volumes/{_seg(volume_id)}", missing="volume")

    # --- the node (aenv extensions) --------------------------------------------------------

    def collect_garbage(self, *, dry_run: bool) -> GcReport:
        resp = self.request("POST", "/admin/gc", params={"dryRun": "true" if dry_run else "false"})
        return parse(resp, GcReport)

    # --- templates (builds go through the e2b SDK: builder.py) ----------------------------

    def templates(self) -> list[tm.Template]:
        """Every page of GET /v2/templates."""
        return self._all_pages("/v2/templates", {}, list[tm.Template])

    def delete_template(self, name_or_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(name_or_id)}", missing="template")


def _seg(value: str) -> str:
    """One path segment: ids like `team/snap:default` must not split the path."""
    return quote(value, safe="")
