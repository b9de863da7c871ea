"""filesystem.Filesystem: one thin method per RPC (resolve user and path, call a helper,
map errors, build the reply). Semantics: shared/spec/e2b-compat.md §4.3-4.4."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from ... import rpc
from ...spec.filesystem.filesystem_connect import Filesystem
from ...spec.filesystem.filesystem_pb import (
    CreateWatcherRequest,
    CreateWatcherResponse,
    GetWatcherEventsRequest,
    GetWatcherEventsResponse,
    ListDirRequest,
    ListDirResponse,
    MakeDirRequest,
    MakeDirResponse,
    MoveRequest,
    MoveResponse,
    RemoveRequest,
    RemoveResponse,
    RemoveWatcherRequest,
    RemoveWatcherResponse,
    StatRequest,
    StatResponse,
    WatchDirRequest,
    WatchDirResponse,
)
from ...state import Defaults
from ...users import User
from . import operations
from .credentials import run_as
from .entry import list_entries
from .errors import connect_errors
from .paths import resolve
from .pollwatch import WatcherRegistry
from .watch import DirWatch, NetworkMountError

Ctx = RequestContext[Any, Any]


def _message(field: str, value: Any) -> WatchDirResponse:
    # protobuf-py types each oneof case with a Literal field name; Oneof() infers str.
    return WatchDirResponse(event=cast(Any, Oneof(field, value)))


async def _watch_messages(watch: DirWatch) -> AsyncIterator[WatchDirResponse]:
    while True:
        yield _message("filesystem", await watch.next_event())


class FilesystemService(Filesystem):
    def __init__(self, defaults: Defaults) -> None:
        self.defaults = defaults
        self.watchers = WatcherRegistry(lambda: secrets.token_hex(12))

    async def aclose(self) -> None:
        await self.watchers.aclose()

    def _resolve(self, ctx: Ctx, path: str) -> tuple[User, str]:
        user = rpc.request_user(ctx, self.defaults)
        return user, resolve(path, user)

    async def stat(self, request: StatRequest, ctx: Ctx) -> StatResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            return StatResponse(entry=await run_as(user, operations.stat_entry, path))

    async def make_dir(self, request: MakeDirRequest, ctx: Ctx) -> MakeDirResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            return MakeDirResponse(entry=await run_as(user, operations.make_dir, path))

    async def move(self, request: MoveRequest, ctx: Ctx) -> MoveResponse:
        with connect_errors():
            user, source = self._resolve(ctx, request.source)
            destination = resolve(request.destination, user)
            return MoveResponse(entry=await run_as(user, operations.move, source, destination))

    async def list_dir(self, request: ListDirRequest, ctx: Ctx) -> ListDirResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            depth = request.depth or 1
            return ListDirResponse(entries=await run_as(user, list_entries, path, depth))

    async def remove(self, request: RemoveRequest, ctx: Ctx) -> RemoveResponse:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            await run_as(user, operations.remove, path)
            return RemoveResponse()

    async def _open_watch(self, request: WatchDirRequest | CreateWatcherRequest,
                          ctx: Ctx) -> DirWatch:
        with connect_errors(request.path):
            user, path = self._resolve(ctx, request.path)
            try:
                return await DirWatch.open(
                    path, recursive=request.recursive, include_entry=request.include_entry,
                    user=user, allow_network_mounts=request.allow_network_mounts)
            except NetworkMountError as exc:
                raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from exc

    async def watch_dir(self, request: WatchDirRequest,
                        ctx: Ctx) -> AsyncIterator[WatchDirResponse]:
        # Deadline (Connect-Timeout-Ms) is enforced by rpc.DeadlineInterceptor, which
        # cancels this generator; a client disconnect ends with_keepalive (notes P4).
        watch = await self._open_watch(request, ctx)
        try:
            # The SDKs block on this first message; the watch is already live (P5).
            yield _message("start", WatchDirResponse.StartEvent())
            async for message in rpc.with_keepalive(
                _watch_messages(watch), interval_s=rpc.keepalive_interval_s(ctx),
                keepalive=lambda: _message("keepalive", WatchDirResponse.KeepAlive()),
            ):
                yield message
        finally:
            watch.close()

    async def create_watcher(self, request: CreateWatcherRequest,
                             ctx: Ctx) -> CreateWatcherResponse:
        watch = await self._open_watch(request, ctx)
        return CreateWatcherResponse(watcher_id=self.watchers.add(watch))

    async def get_watcher_events(self, request: GetWatcherEventsRequest,
                                 ctx: Ctx) -> GetWatcherEventsResponse:
        watcher = self.watchers.get(request.watcher_id)
        if watcher is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher with id '{request.watcher_id}' not found")
        return GetWatcherEventsResponse(events=await watcher.drain())

    async def remove_watcher(self, request: RemoveWatcherRequest,
                             ctx: Ctx) -> RemoveWatcherResponse:
        if not await self.watchers.remove(request.watcher_id):
            raise ConnectError(Code.NOT_FOUND, f"watcher with id '{request.watcher_id}' not found")
        return RemoveWatcherResponse()
