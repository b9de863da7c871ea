"""Waiting for envd inside a guest to answer GET /health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

_CONNECT_S = 0.5
_ATTEMPT_S = 1.0
_INTERVAL_S = 0.05


async def probe_health(url: str) -> bool:
    """One attempt on a fresh connection. User-mode networking accepts the TCP connection
    before the guest listens and then stalls, so a reused or long-lived connection would
    hide the moment envd comes up: short timeouts, new connection every time.

    Written on a bare stream rather than with httpx: a probe reads one status line, and
    an httpx client costs ~20 ms of host CPU to construct (its SSL context) on every
    attempt, on the path of every create and resume."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = (f"GET /health HTTP/1.1\r\nHost: {parts.netloc}\r\n"
               f"Connection: close\r\n\r\n").encode()
    try:
        async with asyncio.timeout(_ATTEMPT_S):
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    _CONNECT_S)
            try:
                writer.write(request)
                await writer.drain()
                status = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError):
        # ValueError: a status line past the reader's 64 KiB limit (not envd's answer)
        return False
    words = status.split()
    return len(words) >= 2 and words[0].startswith(b"HTTP/") and words[1] in (b"200", b"204")


async def wait_for_health(url: str, *, alive: Callable[[], bool]) -> None:
    """Probe until envd answers; returns early (without success) when `alive()` turns
    False. The caller bounds it with `asyncio.timeout` and checks `alive()` afterwards."""
    while alive():
        if await probe_health(url):
            return
        await asyncio.sleep(_INTERVAL_S)
