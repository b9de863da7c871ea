"""Connect RPC plumbing shared by envd's services.

- `interceptors(defaults)`: auth (X-Access-Token), exception → ConnectError mapping,
  Connect-Timeout-Ms enforcement for unary, server- and client-stream RPCs;
- `codecs()`: JSON/proto codecs that answer undecodable bodies with invalid_argument;
- `RefuseGrpcMiddleware`: gRPC content types get a 415 (the body read first);
- `DisconnectMiddleware` + `next_or_disconnect` / `wait_or_disconnect`: let a blocked
  stream handler notice that its client went away;
- `with_keepalive` / `keepalive_interval_s`: keepalive messages on idle streams;
- `request_user` / `request_timeout_s`: per-request user and deadline;
- `to_connect_error` / `map_errors`: the error table, for code outside the interceptors.
"""

from __future__ import annotations

from .codec import StrictCodec, codecs
from .context import request_timeout_s, request_user, request_username
from .disconnect import (
    ClientDisconnected,
    DisconnectMiddleware,
    client_disconnected,
    disconnect_event,
    next_or_disconnect,
    wait_or_disconnect,
)
from .errors import map_errors, to_connect_error
from .grpc import RefuseGrpcMiddleware
from .interceptors import AuthInterceptor, DeadlineInterceptor, ErrorInterceptor, interceptors
from .keepalive import DEFAULT_KEEPALIVE_S, keepalive_interval_s, with_keepalive

__all__ = [
    "DEFAULT_KEEPALIVE_S",
    "AuthInterceptor",
    "ClientDisconnected",
    "DeadlineInterceptor",
    "DisconnectMiddleware",
    "ErrorInterceptor",
    "RefuseGrpcMiddleware",
    "StrictCodec",
    "client_disconnected",
    "codecs",
    "disconnect_event",
    "interceptors",
    "keepalive_interval_s",
    "map_errors",
    "next_or_disconnect",
    "request_timeout_s",
    "request_user",
    "request_username",
    "to_connect_error",
    "wait_or_disconnect",
    "with_keepalive",
]
