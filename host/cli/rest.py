"""The REST API client of the CLI: plain httpx, one method per endpoint the CLI uses."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from .errors import ApiError, ConnectionFailed

USER_AGENT = "aenv-cli/0.1"


def error_message(resp: httpx.Response) -> str:
    """The server's `message` (E2B error body, envd/proxy JSON), else the raw text."""
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

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/v2/sandboxes", json_body=body).json()  # type: ignore[no-any-return]

    def list_sandboxes(self, state: str | None) -> list[dict[str, Any]]:
        """Every page of GET /v2/sandboxes."""
        return self._all_pages("/v2/sandboxes", {"state": state} if state else {})

    def _all_pages(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        """GET `path` page after page, following X-Next-Token until it is absent."""
        out: list[dict[str, Any]] = []
        while True:
            resp = self.request("GET", path, params=params)
            out.extend(resp.json())
            token = resp.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    def get(self, sandbox_id: str) -> dict[str, Any]:
        return self.request("GET", f"/sandboxes/{_seg(sandbox_id)}").json()  # type: ignore[no-any-return]

    def kill(self, sandbox_id: str) -> None:
        self.request("DELETE", f"/sandboxes/{_seg(sandbox_id)}")

    def pause(self, sandbox_id: str, *, memory: bool = True) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/pause",
                     json_body={} if memory else {"memory": False})

    def resume(self, sandbox_id: str, timeout_s: int | None, *,
               memory: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        if not memory:
            body["memory"] = False
        return self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/resume",  # type: ignore[no-any-return]
                            json_body=body).json()

    def connect(self, sandbox_id: str, timeout_s: int | None) -> dict[str, Any]:
        """Resume if paused, else just return the sandbox (POST /v2/.../connect)."""
        body = {} if timeout_s is None else {"timeout": timeout_s}
        return self.request("POST", f"/v2/sandboxes/{_seg(sandbox_id)}/connect",  # type: ignore[no-any-return]
                            json_body=body).json()

    def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/timeout",
                     json_body={"timeout": timeout_s})

    def fork(self, sandbox_id: str, count: int) -> list[dict[str, Any]]:
        return self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/fork",  # type: ignore[no-any-return]
                            json_body={"count": count}).json()

    def logs(self, sandbox_id: str) -> list[dict[str, Any]]:
        body = self.request("GET", f"/v2/sandboxes/{_seg(sandbox_id)}/logs").json()
        return list(body.get("logs", []))

    def metrics(self, sandbox_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/sandboxes/{_seg(sandbox_id)}/metrics").json()  # type: ignore[no-any-return]

    # --- snapshots ----------------------------------------------------------------------

    def snapshot(self, sandbox_id: str, name: str | None) -> dict[str, Any]:
        body = {} if name is None else {"name": name}
        return self.request("POST", f"/sandboxes/{_seg(sandbox_id)}/snapshots",  # type: ignore[no-any-return]
                            json_body=body).json()

    def snapshots(self, sandbox_id: str | None) -> list[dict[str, Any]]:
        return self._all_pages("/snapshots", {"sandboxID": sandbox_id} if sandbox_id else {})

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/templates/{_seg(snapshot_id)}")


def _seg(value: str) -> str:
    """One path segment: ids like `team/snap:default` must not split the path."""
    return quote(value, safe="")
