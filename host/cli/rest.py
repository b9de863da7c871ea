"""The REST API client of the CLI: plain httpx, one method per endpoint the CLI uses.

Answers are parsed with the API's own response models (host.api.models and
template_models), so the CLI reads fields by name and a malformed answer is one error
line, not a KeyError. Template builds are not here: the e2b SDK runs them (builder.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter, ValidationError

from host.api import models as m
from host.api import template_models as tm

from .errors import ApiError, CliError, ConnectionFailed

T = TypeVar("T")

USER_AGENT = "aenv-cli/0.1"


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


def raise_for_status(resp: httpx.Response, *, what: str = "API") -> None:
    if resp.status_code >= 400:
        if not resp.is_closed:
            resp.read()
        raise ApiError(resp.status_code, error_message(resp), what=what)


def parse(resp: httpx.Response, schema: type[T]) -> T:
    """The answer's body as `schema` (a model, or e.g. `list[Model]`)."""
    try:
        return TypeAdapter(schema).validate_json(resp.content)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise CliError(f"unexpected answer from {resp.request.method} {resp.request.url.path}: "
                       f"{where}: {err['msg']}") from exc


@contextlib.contextmanager
def transport_errors(url: str) -> Iterator[None]:
    """httpx transport failures become one-line ConnectionFailed errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ConnectionFailed(f"timed out talking to {url}: {type(exc).__name__}") from exc
    except httpx.TransportError as exc:
        raise ConnectionFailed(f"cannot reach {url}: {exc or type(exc).__name__}") from exc


class ApiClient:
    """The E2B-compatible REST API at `api_url`, authenticated with `api_key`."""

    def __init__(self, api_url: str, api_key: str | None, *, timeout_s: float = 120.0) -> None:
        self.api_url = api_url.rstrip("/")
        headers = {"User-Agent": USER_AGENT}
        if api_key:
            headers["X-API-Key"] = api_key
        self._http = httpx.Client(base_url=self.api_url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, json_body: Any = None,
                params: dict[str, str] | None = None) -> httpx.Response:
        with transport_errors(self.api_url):
            resp = self._http.request(method, path, json=json_body, params=params)
        raise_for_status(resp)
        return resp

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

    def get(self, sandbox_id: str) -> m.SandboxDetail:
        return parse(self.request("GET", f"/sandboxes/{_seg(sandbox_id)}"), m.SandboxDetail)

    def kill(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}")

    def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/pause",
                     json_body={} if memory else {"memory": False})

    def resume(self, sandbox_id: str, timeout_s: int | None, *,
               memory: bool = True) -> m.Sandbox:
        body: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        if not memory:
            body["memory"] = False
        resp = self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/resume", json_body=body)
        return parse(resp, m.Sandbox)

    def connect(self, sandbox_id: str, timeout_s: int | None) -> m.Sandbox:
        """Resume if paused, else just return the sandbox (POST /v2/.../connect)."""
        body = {} if timeout_s is None else {"timeout": timeout_s}
        resp = self.request("POST", f"/v2/sandboxes/{_seg(sandbox_id)}/connect", json_body=body)
        return parse(resp, m.Sandbox)

    def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/timeout",
                     json_body={"timeout": timeout_s})

    def fork(self, sandbox_id: str, count: int) -> list[m.SandboxForkResult]:
        resp = self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/fork",
                            json_body={"count": count})
        return parse(resp, list[m.SandboxForkResult])

    def logs(self, sandbox_id: str) -> list[m.SandboxLogEntry]:
        resp = self.request("GET", f"/v2/sandboxes/{_seg(sandbox_id)}/logs")
        return parse(resp, m.SandboxLogsV2Response).logs

    def metrics(self, sandbox_id: str) -> list[m.SandboxMetric]:
        resp = self.request("GET", f"/sandboxes/{_seg(sandbox_id)}/metrics")
        return parse(resp, list[m.SandboxMetric])

    # --- snapshots ----------------------------------------------------------------------

    def snapshot(self, sandbox_id: str, name: str | None) -> m.SnapshotInfo:
        body = {} if name is None else {"name": name}
        resp = self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/snapshots", json_body=body)
        return parse(resp, m.SnapshotInfo)

    def snapshots(self, sandbox_id: str | None) -> list[m.SnapshotInfo]:
        return self._all_pages("/snapshots", {"sandboxID": sandbox_id} if sandbox_id else {},
                               list[m.SnapshotInfo])

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(snapshot_id)}")

    # --- templates (builds go through the e2b SDK: builder.py) ----------------------------

    def templates(self) -> list[tm.Template]:
        """Every page of GET /v2/templates."""
        return self._all_pages("/v2/templates", {}, list[tm.Template])

    def delete_template(self, name_or_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(name_or_id)}")


def _seg(value: str) -> str:
    """One path segment: ids like `team/snap:default` must not split the path."""
    return quote(value, safe="")
