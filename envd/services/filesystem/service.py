"""filesystem.Filesystem: one thin method per RPC (resolve user and path, call a helper,
map errors, build the reply). Semantics: shared/spec/e2b-compat.md §4.3-4.4."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from ...auth import basic_auth_user
from ...spec.filesystem.filesystem_connect import Filesystem
from ...spec.filesystem.filesystem_pb import (
    CreateWatcherRequest, CreateWatcherResponse, GetWatcherEventsRequest,
    GetWatcherEventsResponse, ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse,
    MoveRequest, MoveResponse, RemoveRequest, RemoveResponse, RemoveWatcherRequest,
    RemoveWatcherResponse, StatRequest, StatResponse, WatchDirRequest, WatchDirResponse,
)
from ...state import Defaults
from ...users import User
from . import operations
from .credentials import run_as
from .entry import list_entries
from .errors import connect_errors
from .paths import resolve
from .streams import keepalive_interval_s, next_or_disconnect
from .watch import DirWatch, NetworkMountError, WatcherRegistry


def request_user(defaults: Defaults, ctx: RequestContext) -> User:
    """The user named by `Authorization: Basic`, else the sandbox default user."""
    name = basic_auth_user(ctx.request_headers.get("authorization")) or defaults.user
    return User.lookup(name)


class FilesystemService(Filesystem):
    def __init__(self, defaults: Defaults) -> None:
        self.defaults = defaults
        self.watchers = WatcherRegistry(lambda: secrets.token_hex(12))

    async def aclose(self) -> None:
        await self.watchers.aclose()

    def _resolve(self, ctx: RequestContext, path: str) -> tuple[User, str]:
        user = request_user(self.defaults, ctx)
        return user, resolve(path, user)

    async def stat(self, request: StatRequest, ctx: RequestContext) -> StatResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            return StatResponse(entry=await run_as(user, operations.stat_entry, path))

    async def make_dir(self, request: MakeDirRequest, ctx: RequestContext) -> MakeDirResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            return MakeDirResponse(entry=await run_as(user, operations.make_dir, path))

    async def move(self, request: MoveRequest, ctx: RequestContext) -> MoveResponse:
        with connect_errors():
            user, source = self._resolve(ctx, request.source)
            destination = resolve(request.destination, user)
            return MoveResponse(entry=await run_as(user, operations.move, source, destination))

    async def list_dir(self, request: ListDirRequest, ctx: RequestContext) -> ListDirResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            depth = request.depth or 1
            return ListDirResponse(entries=await run_as(user, list_entries, path, depth))

    async def remove(self, request: RemoveRequest, ctx: RequestContext) -> RemoveResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            await run_as(user, operations.remove, path)
            return RemoveResponse()

    async def _open_watch(self, request: WatchDirRequest | CreateWatcherRequest,
                          ctx: RequestContext) -> DirWatch:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            try:
                return await DirWatch.open(
                    path, recursive=request.recursive, include_entry=request.include_entry,
                    user=user, allow_network_mounts=request.allow_network_mounts)
            except NetworkMountError as exc:
                raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from exc

    async def watch_dir(self, request: WatchDirRequest,
                        ctx: RequestContext) -> AsyncIterator[WatchDirResponse]:
        watch = await self._open_watch(request, ctx)
        try:
            # The SDKs block on this first message; the watch is already live (P5).
            yield WatchDirResponse(event=Oneof("start", WatchDirResponse.StartEvent()))
            keepalive_s = keepalive_interval_s(ctx)
            loop = asyncio.get_running_loop()
            deadline = None if ctx.timeout_ms is None else loop.time() + ctx.timeout_ms / 1000
            while True:
                wait_s = keepalive_s
                if deadline is not None:
                    wait_s = min(wait_s, deadline - loop.time())
                    if wait_s <= 0:
                        raise ConnectError(Code.DEADLINE_EXCEEDED, "watch deadline exceeded")
                try:
                    event = await asyncio.wait_for(next_or_disconnect(watch.next_event()), wait_s)
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        continue  # reported at the top of the loop
                    yield WatchDirResponse(event=Oneof("keepalive", WatchDirResponse.KeepAlive()))
                    continue
                if event is None:
                    return  # the client went away
                yield WatchDirResponse(event=Oneof("filesystem", event))
        finally:
            watch.close()

    async def create_watcher(self, request: CreateWatcherRequest,
                             ctx: RequestContext) -> CreateWatcherResponse:
        watch = await self._open_watch(request, ctx)
        return CreateWatcherResponse(watcher_id=self.watchers.add(watch))

    async def get_watcher_events(self, request: GetWatcherEventsRequest,
                                 ctx: RequestContext) -> GetWatcherEventsResponse:
        watcher = self.watchers.get(request.watcher_id)
        if watcher is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id '{request.watcher_id}' not found")
        return GetWatcherEventsResponse(events=watcher.drain())

    async def remove_watcher(self, request: RemoveWatcherRequest,
                             ctx: RequestContext) -> RemoveWatcherResponse:
        if not await self.watchers.remove(request.watcher_id):
            raise ConnectError(Code.NOT_FOUND, f"watcher with id '{request.watcher_id}' not found")
        return RemoveWatcherResponse()
