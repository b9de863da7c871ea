"""The gateway's client of the scheduler's API (scheduler/app.py): one placement per call,
its E2B errors turned back into the cluster's errors."""

from __future__ import annotations

from typing import Any

import httpx

from ..errors import (
    ClusterError,
    NoCapacity,
    SandboxLost,
    SandboxUnknown,
    SchedulerUnavailable,
)
from ..scheduler.service import Placement, PlacementRequest

_BY_STATUS: dict[int, type[ClusterError]] = {429: NoCapacity, 404: SandboxUnknown,
                                             410: SandboxLost}


class SchedulerClient:
    def __init__(self, url: str, key: str | None, *, timeout_s: float = 15.0) -> None:
        headers = {"X-API-Key": key} if key else {}
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(timeout_s, connect=3.0))
        self.url = url

    async def aclose(self) -> None:
        await self._http.aclose()

    async def place(self, req: PlacementRequest) -> Placement:
        try:
            resp = await self._http.post("/placements", json=req.wire())
        except httpx.HTTPError as exc:
            raise SchedulerUnavailable(f"the scheduler at {self.url} is unreachable: "
                                       f"{exc or type(exc).__name__}") from exc
        if resp.status_code == 201:
            return Placement.from_wire(resp.json())
        message = _message(resp)
        error = _BY_STATUS.get(resp.status_code)
        if error is not None:
            raise error(message)
        raise SchedulerUnavailable(f"the scheduler answered {resp.status_code}: {message}")


def _message(resp: httpx.Response) -> str:
    try:
        body: Any = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])
    return resp.text[:300]
