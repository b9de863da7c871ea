"""Waiting for envd inside a guest to answer GET /health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

_ATTEMPT = httpx.Timeout(1.0, connect=0.5)
_INTERVAL_S = 0.05


async def probe_health(url: str) -> bool:
    """One attempt on a fresh connection. User-mode networking accepts the TCP connection
    before the guest listens and then stalls, so a reused or long-lived connection would
    hide the moment envd comes up: short timeouts, new connection every time."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=_ATTEMPT, limits=limits, trust_env=False) as client:
        try:
            resp = await client.get(f"{url}/health")
        except httpx.HTTPError:
            return False
    return resp.status_code in (200, 204)


async def wait_for_health(url: str, *, alive: Callable[[], bool]) -> None:
    """Probe until envd answers; returns early (without success) when `alive()` turns
    False. The caller bounds it with `asyncio.timeout` and checks `alive()` afterwards."""
    while alive():
        if await probe_health(url):
            return
        await asyncio.sleep(_INTERVAL_S)
