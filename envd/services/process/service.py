"""process.Process Connect service: one thin method per RPC over the ProcessTable."""

from __future__ import annotations

import contextlib
import signal as signals
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from ... import rpc
from ...spec.process import process_pb as pb
from ...spec.process.process_connect import Process
from ...state import Defaults
from .fanout import SubscriberDropped, Subscription
from .launch import spawn_spec
from .proc import ExitStatus, Output, Proc, ProcessStateError
from .table import ProcessNotFound, ProcessTable

Ctx = RequestContext[Any, Any]

_SIGNALS = {pb.Signal.SIGKILL: signals.SIGKILL, pb.Signal.SIGTERM: signals.SIGTERM}


@contextlib.contextmanager
def process_errors() -> Iterator[None]:
    """Process-specific failures → Connect codes (the rest goes to rpc's table)."""
    try:
        yield
    except ProcessNotFound as exc:
        raise ConnectError(Code.NOT_FOUND, str(exc)) from None
    except ProcessStateError as exc:
        raise ConnectError(Code.FAILED_PRECONDITION, str(exc)) from None
    except SubscriberDropped as exc:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, str(exc)) from None


def _event(**kw: Any) -> pb.ProcessEvent:
    ((field, value),) = kw.items()
    return pb.ProcessEvent(event=cast(Any, Oneof(field, value)))


def start_event(pid: int) -> pb.ProcessEvent:
    return _event(start=pb.ProcessEvent.StartEvent(pid=pid))


def keepalive_event() -> pb.ProcessEvent:
    return _event(keepalive=pb.ProcessEvent.KeepAlive())


def end_event(status: ExitStatus) -> pb.ProcessEvent:
    end = pb.ProcessEvent.EndEvent(exit_code=status.exit_code, exited=status.exited,
                                   status=status.status)
    if status.error is not None:
        end.error = status.error
    return _event(end=end)


def data_event(kind: str, data: bytes) -> pb.ProcessEvent:
    return _event(data=pb.ProcessEvent.DataEvent(output=cast(Any, Oneof(kind, data))))


async def process_events(sub: Subscription[Output, ExitStatus]) -> AsyncIterator[pb.ProcessEvent]:
    """A subscription as ProcessEvents: data..., then end."""
    with process_errors():
        async for item in sub:
            if isinstance(item, ExitStatus):
                yield end_event(item)
                return
            yield data_event(*item)


class ProcessService(Process):
    def __init__(self, defaults: Defaults, *,
                 keepalive_default_s: float = rpc.DEFAULT_KEEPALIVE_S) -> None:
        self.defaults = defaults
        self.table = ProcessTable()
        self._keepalive_default_s = keepalive_default_s

    def _select(self, selector: pb.ProcessSelector | None) -> Proc:
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=int(pid)):
                return self.table.by_pid(pid)
            case Oneof(field="tag", value=str(tag)):
                return self.table.by_tag(tag)
        raise ConnectError(Code.INVALID_ARGUMENT, "process selector (pid or tag) is required")

    async def _stream(self, proc: Proc, sub: Subscription[Output, ExitStatus], ctx: Ctx,
                      wrap: Callable[[pb.ProcessEvent], Any]) -> AsyncIterator[Any]:
        try:
            # P5: the start event goes out before anything else is awaited.
            yield wrap(start_event(proc.pid))
            interval = rpc.keepalive_interval_s(ctx, self._keepalive_default_s)
            async for event in rpc.with_keepalive(process_events(sub), interval_s=interval,
                                                  keepalive=keepalive_event):
                yield wrap(event)
        finally:
            sub.close()

    # -- RPCs -------------------------------------------------------------------
    async def start(self, request: pb.StartRequest, ctx: Ctx) -> AsyncIterator[pb.StartResponse]:
        user = rpc.request_user(ctx, self.defaults)
        spec = spawn_spec(request, user, self.defaults)
        # Connect-Timeout-Ms is the process lifetime; a client disconnect is not.
        proc, sub = await self.table.spawn(spec, lifetime_s=rpc.request_timeout_s(ctx))
        async for message in self._stream(proc, sub, ctx,
                                          lambda e: pb.StartResponse(event=e)):
            yield message

    async def connect(self, request: pb.ConnectRequest,
                      ctx: Ctx) -> AsyncIterator[pb.ConnectResponse]:
        with process_errors():
            proc = self._select(request.process)
        sub = proc.subscribe()
        async for message in self._stream(proc, sub, ctx,
                                          lambda e: pb.ConnectResponse(event=e)):
            yield message

    async def list(self, request: pb.ListRequest, ctx: Ctx) -> pb.ListResponse:
        infos = []
        for proc in self.table:
            config = proc.spec.meta if isinstance(proc.spec.meta, pb.ProcessConfig) \
                else pb.ProcessConfig(cmd=proc.spec.argv[0], args=proc.spec.argv[1:])
            info = pb.ProcessInfo(config=config, pid=proc.pid)
            if proc.tag is not None:
                info.tag = proc.tag
            infos.append(info)
        return pb.ListResponse(processes=infos)

    async def send_input(self, request: pb.SendInputRequest, ctx: Ctx) -> pb.SendInputResponse:
        with process_errors():
            proc = self._select(request.process)
            await self._write(proc, request.input)
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest],
                           ctx: Ctx) -> pb.StreamInputResponse:
        proc: Proc | None = None
        with process_errors():
            async for message in request:
                match message.event:
                    case Oneof(field="start", value=pb.StreamInputRequest.StartEvent() as start):
                        proc = self._select(start.process)
                    case Oneof(field="data", value=pb.StreamInputRequest.DataEvent() as data):
                        if proc is None:
                            raise ConnectError(Code.FAILED_PRECONDITION,
                                               "the first StreamInput message must be start")
                        await self._write(proc, data.input)
                    case _:  # keepalive (or an empty message): nothing to do
                        pass
        return pb.StreamInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest,
                          ctx: Ctx) -> pb.SendSignalResponse:
        sig = _SIGNALS.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal!r}")
        with process_errors():
            self._select(request.process).signal(sig)
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest,
                          ctx: Ctx) -> pb.CloseStdinResponse:
        with process_errors():
            self._select(request.process).close_stdin()
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: Ctx) -> pb.UpdateResponse:
        with process_errors():
            proc = self._select(request.process)
            if request.pty is not None and request.pty.size is not None:
                size = request.pty.size
                try:
                    proc.resize(size.cols, size.rows)
                except ValueError as exc:
                    raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from None
        return pb.UpdateResponse()

    @staticmethod
    async def _write(proc: Proc, data: pb.ProcessInput | None) -> None:
        match data.input if data is not None else None:
            case Oneof(field="stdin" | "pty", value=chunk):
                await proc.write_input(chunk)
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "input (stdin or pty) is required")

    # -- lifecycle ------------------------------------------------------------------
    async def aclose(self) -> None:
        await self.table.aclose()


__all__ = ["ProcessService", "process_errors"]
