"""The HTTP API of the code interpreter (what the e2b code-interpreter SDKs call).

    GET    /health                  "OK" once the default python kernel is warm
    POST   /execute                 NDJSON stream of one execution's outputs
    GET    /contexts                [{id, language, cwd}]
    POST   /contexts                {language?, cwd?} -> {id, language, cwd}
    DELETE /contexts/{id}
    POST   /contexts/{id}/restart

Errors are plain-text bodies (the SDKs put the text into their exception) with the status
from `_STATUS`; 404 becomes the SDKs' NotFound error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .contexts import Context, ContextRegistry
from .errors import CodeInterpreterError, ContextNotFoundError, KernelError, RequestError
from .execution import Job
from .languages import DEFAULT_CONTEXT_LANGUAGES, normalize_language
from .models import CreateContextRequest, ExecuteRequest
from .settings import Settings

log = logging.getLogger(__name__)

_STATUS: dict[type[CodeInterpreterError], int] = {
    RequestError: 400,
    ContextNotFoundError: 404,
    KernelError: 500,
}
Endpoint = Callable[[Request], Awaitable[Response]]


def _registry(request: Request) -> ContextRegistry:
    registry: ContextRegistry = request.app.state.registry
    return registry


def _mapped(endpoint: Endpoint) -> Endpoint:
    """Our exceptions -> their status with the message as a plain-text body."""

    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except CodeInterpreterError as exc:
            status = next((s for cls, s in _STATUS.items() if isinstance(exc, cls)), 500)
            if status >= 500:
                log.error("%s %s: %s", request.method, request.url.path, exc)
            return PlainTextResponse(str(exc), status_code=status)

    return wrapper


async def health(request: Request) -> Response:
    return JSONResponse("OK")


async def execute(request: Request) -> Response:
    body = ExecuteRequest.parse(await request.body())
    registry = _registry(request)
    context: Context
    if body.context_id:
        context = registry.get(body.context_id)
    else:
        context = await registry.default(normalize_language(body.language))
    job = Job(code=body.code, env_vars=body.env_vars,
              access_token=request.headers.get("x-access-token"))
    context.submit(job)
    keepalive_s = request.app.state.settings.keepalive_s

    async def stream() -> AsyncIterator[bytes]:
        # uvicorn (ASGI spec 2.3) tells StreamingResponse about a client disconnect and
        # it cancels this generator: the job is then cancelled, which interrupts the
        # kernel. The SDKs' `timeout` works this way: they close the connection.
        try:
            async for line in job.lines(keepalive_s):
                yield line
        finally:
            job.cancel()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


async def list_contexts(request: Request) -> Response:
    return JSONResponse([c.to_json() for c in _registry(request).list()])


async def create_context(request: Request) -> Response:
    body = CreateContextRequest.parse(await request.body())
    context = await _registry(request).create(body.language, body.cwd)
    return JSONResponse(context.info().to_json())


async def remove_context(request: Request) -> Response:
    await _registry(request).remove(request.path_params["context_id"])
    return JSONResponse(None)


async def restart_context(request: Request) -> Response:
    await _registry(request).restart(request.path_params["context_id"])
    return JSONResponse(None)


def build_app(settings: Settings) -> Starlette:
    """The app; its lifespan makes the default contexts (the warm ones' kernels started)
    before serving."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = ContextRegistry(settings)
        app.state.settings = settings
        app.state.registry = registry
        try:
            # as E2B's server: the python and javascript contexts exist before the first
            # request; the warm ones' kernels run already (and so are in the template's
            # snapshot), the others' start on first use, like other languages' contexts
            for lang in dict.fromkeys((*settings.warm_languages, *DEFAULT_CONTEXT_LANGUAGES)):
                await registry.default(lang, start=lang in settings.warm_languages)
            log.info("default contexts: %s, warm: %s (cwd %s)",
                     ", ".join(DEFAULT_CONTEXT_LANGUAGES), ", ".join(settings.warm_languages),
                     settings.default_cwd)
            yield
        finally:
            await registry.aclose()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/execute", _mapped(execute), methods=["POST"]),
        Route("/contexts", _mapped(list_contexts), methods=["GET"]),
        Route("/contexts", _mapped(create_context), methods=["POST"]),
        Route("/contexts/{context_id}", _mapped(remove_context), methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", _mapped(restart_context), methods=["POST"]),
    ]
    # browsers call the sandbox's port directly with the JS SDK, as on E2B
    middleware = [Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"],
                             allow_headers=["*"])]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
