"""Requests in the gRPC protocols (`application/grpc*`) get a 415, as Connect servers
answer a content type they do not serve.

envd speaks Connect (what the E2B SDKs use). connectrpc's ASGI app would take a gRPC
request and then fail with a 500, because trailers need an ASGI extension uvicorn lacks;
worse, it answered before reading the request body, so uvicorn closed the connection
under the next request a proxy sent on it (found by the fuzz run, tests/e2e/test_fuzz.py).
Here the body is read to its end first, so the connection stays usable.
"""

from __future__ import annotations

import json
from typing import Any

_MESSAGE = json.dumps({"code": "unimplemented",
                       "message": "gRPC is not served here; use the Connect protocol "
                                  "(application/connect+proto or +json, application/proto "
                                  "or /json)"}).encode()


class RefuseGrpcMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _is_grpc(scope):
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 415,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_MESSAGE)).encode())]})
        await send({"type": "http.response.body", "body": _MESSAGE})


def _is_grpc(scope: Any) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return bytes(value).split(b";", 1)[0].strip().lower().startswith(b"application/grpc")
    return False
