"""The proxy's own answers, as JSON bodies the SDKs understand (spec §1.6.7)."""

from __future__ import annotations

import json

from starlette.types import Send

NOT_FOUND = "The sandbox was not found"          # Py: "was not found" -> SandboxNotRunning
PORT_CLOSED = "The sandbox is running but port is not open"   # Py: -> SandboxUnreachable
END_GRACE_S = 5.0  # for the last messages to a client when the sandbox went away


def body(status: int, message: str, sandbox_id: str | None = None,
         port: int | None = None) -> bytes:
    out: dict[str, object] = {}
    if sandbox_id is not None:
        out["sandboxId"] = sandbox_id
    out["message"] = message
    if port is not None:
        out["port"] = port
    out["code"] = status
    return json.dumps(out).encode()


async def send_json(send: Send, status: int, message: str, *, sandbox_id: str | None = None,
                    port: int | None = None) -> None:
    payload = body(status, message, sandbox_id, port)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]})
    await send({"type": "http.response.body", "body": payload})
