"""The client side of Firecracker's REST API: HTTP/1.1 over its unix socket.

`FirecrackerApi.connect()` polls `GET /` until the process answers (or exits, or the
deadline passes); `request()` sends one call and maps failures to the driver's errors:
a 4xx/5xx answer becomes VmmError with Firecracker's `fault_message`, a call that runs
past its deadline VmmTimeout, a connection lost because the process exited
VmmStartError (with the serial and stderr tails).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from ..errors import VmmError, VmmStartError, VmmTimeout

API_CALL_S = 10.0


class FirecrackerApi:
    """One VM's API connection. `exited()` is the process's exit code (None while it
    runs), `died()` the same after a short wait for the reaper, `tails()` the log tails
    for error messages."""

    def __init__(self, socket: Path, *, name: str, exited: Callable[[], int | None],
                 died: Callable[[], Awaitable[int | None]],
                 tails: Callable[[], dict[str, str]]) -> None:
        self.socket = socket
        self.name = name
        self._exited = exited
        self._died = died
        self._tails = tails
        self._client: httpx.AsyncClient | None = None

    async def connect(self, *, deadline: float, timeout_s: float) -> None:
        """Poll GET / until it answers 200; VmmStartError if the process exits first,
        VmmTimeout at `deadline` (loop time)."""
        loop = asyncio.get_running_loop()
        client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
                                   base_url="http://localhost", trust_env=False,
                                   timeout=httpx.Timeout(API_CALL_S, connect=0.5))
        try:
            while True:
                rc = self._exited()
                if rc is not None:
                    raise VmmStartError(f"{self.name}: Firecracker exited with code {rc} "
                                        "during startup", **self._tails())
                if self.socket.exists():  # follows the symlink into a jail
                    with contextlib.suppress(httpx.TransportError):
                        resp = await client.get("/")
                        if resp.status_code == 200:
                            self._client = client
                            return
                if loop.time() > deadline:
                    raise VmmTimeout(f"{self.name}: Firecracker API did not answer within "
                                     f"{timeout_s}s", **self._tails())
                await asyncio.sleep(0.005)
        finally:
            if self._client is not client:
                await client.aclose()

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                      timeout_s: float = API_CALL_S) -> Any:
        """One call; the decoded JSON answer (None for 204)."""
        if self._client is None:
            raise VmmError(f"{self.name}: API not connected")
        try:
            resp = await self._client.request(method, path, json=body, timeout=timeout_s)
        except httpx.TimeoutException as exc:
            raise VmmTimeout(f"{self.name}: {method} {path} took over {timeout_s}s",
                             **self._tails()) from exc
        except httpx.HTTPError as exc:
            rc = await self._died()
            if rc is not None:
                raise VmmStartError(f"{self.name}: Firecracker exited with code {rc} "
                                    f"(during {method} {path})", **self._tails()) from exc
            raise VmmError(f"{self.name}: {method} {path}: {exc!r}") from exc
        if resp.status_code >= 300:
            try:
                fault = resp.json().get("fault_message", resp.text)
            except ValueError:
                fault = resp.text
            raise VmmError(f"{self.name}: {method} {path} failed ({resp.status_code}): "
                           f"{fault}")
        return resp.json() if resp.content else None

    async def aclose(self) -> None:
        """Close the connection (errors ignored)."""
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
