"""Interceptors every envd Connect service runs: auth, error mapping, deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from ..auth import AuthError, require_token
from ..state import Defaults
from .context import request_timeout_s
from .errors import to_connect_error

Ctx = RequestContext[Any, Any]


class AuthInterceptor:
    """Leading metadata interceptor: checks X-Access-Token before the body is read."""

    def __init__(self, defaults: Defaults) -> None:
        self._defaults = defaults

    async def on_start(self, ctx: Ctx) -> None:
        try:
            require_token(self._defaults, ctx.request_headers.get("x-access-token"))
        except AuthError as exc:
            raise ConnectError(Code.UNAUTHENTICATED, str(exc)) from None

    async def on_end(self, token: None, ctx: Ctx, error: Exception | None) -> None:
        return None


class ErrorInterceptor:
    """Maps any exception a handler raises to a ConnectError (see errors.py)."""

    async def intercept_unary(self, call_next: Callable[[Any, Ctx], Awaitable[Any]],
                              request: Any, ctx: Ctx) -> Any:
        try:
            return await call_next(request, ctx)
        except ConnectError:
            raise
        except Exception as exc:
            raise to_connect_error(exc) from exc

    async def intercept_client_stream(
        self, call_next: Callable[[AsyncIterator[Any], Ctx], Awaitable[Any]],
        request: AsyncIterator[Any], ctx: Ctx,
    ) -> Any:
        try:
            return await call_next(request, ctx)
        except ConnectError:
            raise
        except Exception as exc:
            raise to_connect_error(exc) from exc

    async def intercept_server_stream(
        self, call_next: Callable[[Any, Ctx], AsyncIterator[Any]], request: Any, ctx: Ctx,
    ) -> AsyncIterator[Any]:
        stream = call_next(request, ctx)
        try:
            async for message in stream:
                yield message
        except ConnectError:
            raise
        except Exception as exc:
            raise to_connect_error(exc) from exc
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def _deadline_error() -> ConnectError:
    return ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded")


class DeadlineInterceptor:
    """Enforces Connect-Timeout-Ms on the server (connectrpc only parses it, P3).

    Each wait is bounded with `asyncio.timeout_at` in the request's own task: the
    cancellation lands in the handler's await, never in connectrpc's `send`.
    """

    async def intercept_unary(self, call_next: Callable[[Any, Ctx], Awaitable[Any]],
                              request: Any, ctx: Ctx) -> Any:
        return await self._bounded(call_next(request, ctx), ctx)

    async def intercept_client_stream(
        self, call_next: Callable[[AsyncIterator[Any], Ctx], Awaitable[Any]],
        request: AsyncIterator[Any], ctx: Ctx,
    ) -> Any:
        return await self._bounded(call_next(request, ctx), ctx)

    async def intercept_server_stream(
        self, call_next: Callable[[Any, Ctx], AsyncIterator[Any]], request: Any, ctx: Ctx,
    ) -> AsyncIterator[Any]:
        stream = call_next(request, ctx)
        remaining = request_timeout_s(ctx)
        if remaining is None:
            async for message in stream:
                yield message
            return
        deadline = asyncio.get_running_loop().time() + remaining
        iterator = aiter(stream)
        try:
            while True:
                timeout = asyncio.timeout_at(deadline)
                try:
                    async with timeout:
                        message = await anext(iterator)
                except StopAsyncIteration:
                    return
                except Exception:
                    # Usually TimeoutError; but code that turns the cancellation into
                    # another error (connectrpc's request reader raises CANCELED) must
                    # still report the deadline.
                    if timeout.expired():
                        raise _deadline_error() from None
                    raise
                yield message
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    @staticmethod
    async def _bounded(aw: Awaitable[Any], ctx: Ctx) -> Any:
        remaining = request_timeout_s(ctx)
        if remaining is None:
            return await aw
        timeout = asyncio.timeout(remaining)
        try:
            async with timeout:
                return await aw
        except Exception:  # see intercept_server_stream
            if timeout.expired():
                raise _deadline_error() from None
            raise


def interceptors(defaults: Defaults) -> Sequence[Any]:
    """Interceptors for every Connect service (auth first: it runs before body parsing)."""
    return (AuthInterceptor(defaults), ErrorInterceptor(), DeadlineInterceptor())


__all__ = ["AuthInterceptor", "DeadlineInterceptor", "ErrorInterceptor", "interceptors"]
