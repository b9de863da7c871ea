"""A small HTTP/1.1 client for the proxy's upstream side: per-target idle connection pools
over asyncio streams, h11 for framing, request and response bodies streamed.

Why not httpx: httpcore's pool re-scans every connection for every queued request
(O(requests x connections)); at 50 concurrent streams that cost ~10 ms per request on
this 2-core host (67 req/s vs thousands for nginx). Here acquiring a connection is a
list pop, and a proxy needs nothing else from a client (no redirects, cookies, decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import h11

_READ_SIZE = 256 * 1024
# An idempotent request that failed on a reused connection before any response byte is
# sent again on a fresh one; body chunks already read from the client are kept (up to
# this much) for that.
_REPLAY_LIMIT = 64 * 1024
# Methods whose second execution does what the first did (RFC 9110 §9.2.2). Any other
# request (a Connect RPC such as process.Start, POST /files) may have run upstream once
# its head was written: it is never sent twice.
IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
_SWEEP_S = 10.0  # at most this often, idle connections past their expiry are closed


class UpstreamError(Exception):
    """The upstream closed or broke the connection (after we connected)."""


class UpstreamUnreachable(UpstreamError):
    """Nothing accepts connections on the target port (refused / connect timeout)."""


@dataclass
class UpstreamResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    conn: Connection

    def aiter_body(self) -> AsyncGenerator[bytes, None]:
        return self.conn.body()

    def abandon(self) -> None:
        """Call after the body iterator was closed: a body never read to its end (or never
        started: closing an unstarted generator runs none of its code) closes the
        connection instead of leaving it open outside the pool."""
        self.conn.abandon()


class Connection:
    """One keep-alive HTTP/1.1 connection to an upstream."""

    def __init__(self, pool: Pool, key: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.pool = pool
        self.key = key
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = time.monotonic()
        self.reused = False
        self.wrote = False     # the current request's head was handed to the socket
        self.received = False  # a byte of the current response has arrived
        self.responding = False  # a response was handed out and not yet finished

    def stale(self, expiry_s: float) -> bool:
        """An idle connection that must not be reused: expired, closed, or its peer has
        closed / reset it or sent something while idle (never valid between responses)."""
        if (self.writer.is_closing() or self.reader.at_eof()
                or self.reader.exception() is not None
                or time.monotonic() - self.idle_since > expiry_s):
            return True
        if getattr(self.reader, "_buffer", b""):  # unsolicited bytes while idle
            return True
        return not self._socket_quiet()

    def _socket_quiet(self) -> bool:
        """True if the socket has nothing to read and no error (EOF/RST not yet seen by the
        event loop is caught here: a non-blocking MSG_PEEK on a duplicate of the fd)."""
        ts = self.writer.get_extra_info("socket")
        if ts is None:
            return True
        try:
            with socket.socket(fileno=ts.dup().detach()) as sock:
                return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False

    async def _send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def request(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]],
                      body: AsyncIterator[bytes] | None) -> UpstreamResponse:
        self.received = self.wrote = False
        try:
            await self._send(h11.Request(method=method, target=target, headers=headers))
            self.wrote = True
            if body is not None:
                async for chunk in body:
                    await self._send(h11.Data(data=chunk))
            await self._send(h11.EndOfMessage())
            while True:
                event = await self._next_event()
                if isinstance(event, h11.Response):
                    self.responding = True
                    return UpstreamResponse(event.status_code, list(event.headers), self)
                if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                    self.responding = True
                    return UpstreamResponse(101, list(event.headers), self)
                if isinstance(event, h11.ConnectionClosed):
                    raise UpstreamError("the upstream closed the connection before responding")
                # other 1xx (100 Continue, 103): the client side already handled those
        except (OSError, h11.ProtocolError) as exc:
            self.close()
            raise UpstreamError(str(exc) or type(exc).__name__) from exc
        except BaseException:  # UpstreamError, cancellation, a failing request body
            self.close()
            raise

    async def _next_event(self) -> h11.Event:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(_READ_SIZE)
                if data:
                    self.received = True
                self.h11.receive_data(data)  # b"" = EOF; h11 raises if that is premature
                continue
            if event is h11.PAUSED:
                raise UpstreamError("unexpected pause in the upstream response")
            return event  # type: ignore[return-value]

    async def body(self) -> AsyncGenerator[bytes, None]:
        """Response body chunks as read; returns the connection to the pool at the end."""
        done = False
        try:
            while True:
                try:
                    event = await self._next_event()
                except (OSError, h11.ProtocolError) as exc:
                    raise UpstreamError(str(exc) or type(exc).__name__) from exc
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    done = True
                    return
        finally:
            self.finish(done)

    def finish(self, complete: bool) -> None:
        self.responding = False
        if complete and self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.pool.release(self)
        else:
            self.close()

    def abandon(self) -> None:
        if self.responding:
            self.finish(False)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Pool:
    """Idle connections per (host, port); LIFO so warm connections are reused first."""

    def __init__(self, *, connect_timeout_s: float = 5.0, max_idle_per_target: int = 128,
                 idle_expiry_s: float = 60.0, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: every connection of this pool is TLS, verified with this context against
        the target's host name (the cluster gateway to https:// nodes)."""
        self.connect_timeout_s = connect_timeout_s
        self.tls = tls
        self.max_idle = max_idle_per_target
        self.idle_expiry_s = idle_expiry_s
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._closed = False
        self._swept = time.monotonic()

    async def _open(self, key: tuple[str, int]) -> Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    key[0], key[1], limit=_READ_SIZE, ssl=self.tls,
                    server_hostname=key[0] if self.tls is not None else None)
        except (OSError, TimeoutError) as exc:   # ssl.SSLError (a refused certificate) too
            raise UpstreamUnreachable(f"{key[0]}:{key[1]}: {exc or 'connect timeout'}") from exc
        return Connection(self, key, reader, writer)

    def _pop_idle(self, key: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.stale(self.idle_expiry_s):
                conn.reused = True
                return conn
            conn.close()
        return None

    async def request(self, host: str, port: int, method: bytes, target: bytes,
                      headers: list[tuple[bytes, bytes]],
                      body: AsyncIterator[bytes] | None) -> UpstreamResponse:
        """Send one request. On a reused connection that fails before any response byte
        (the peer closed it while idle, or it is a dead connection to an address that now
        belongs to someone else, who answers with a reset) the request is sent once more on
        a fresh connection only when that cannot run it twice: its head never reached the
        socket, or its method is idempotent; and the body read so far can be replayed in
        full (empty, not started, or at most _REPLAY_LIMIT bytes kept). Otherwise the
        error stands (the client gets a 502 and decides)."""
        key = (host, port)
        self._sweep()
        conn = self._pop_idle(key)
        if conn is None:
            conn = await self._open(key)
            return await conn.request(method, target, headers, body)
        replay = _Replay(body) if body is not None else None
        try:
            return await conn.request(method, target, headers,
                                      replay.first() if replay is not None else None)
        except UpstreamError:
            if (conn.received or (conn.wrote and method not in IDEMPOTENT)
                    or (replay is not None and not replay.replayable)):
                raise
        fresh = await self._open(key)
        return await fresh.request(method, target, headers,
                                   replay.again() if replay is not None else None)

    def release(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= self.max_idle or conn.stale(self.idle_expiry_s):
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def drop(self, host: str) -> int:
        """Close the idle connections to `host` (any port): a sandbox's run ended, its
        address is dead or will belong to another sandbox. Returns how many."""
        closed = 0
        for key in [k for k in self._idle if k[0] == host]:
            for conn in self._idle.pop(key):
                conn.close()
                closed += 1
        return closed

    def _sweep(self) -> None:
        """Close idle connections past their expiry (at most every _SWEEP_S): without
        it they would stay open until their target is asked for again."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_S:
            return
        self._swept = now
        for key in list(self._idle):
            keep = []
            for conn in self._idle[key]:
                if now - conn.idle_since > self.idle_expiry_s:
                    conn.close()
                else:
                    keep.append(conn)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


class _Replay:
    """A request body read once from the client, keeping what was read (up to
    _REPLAY_LIMIT) so that a retry can send it again and then go on with the rest."""

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        self.source = source
        self.kept: list[bytes] = []
        self.size = 0
        self.replayable = True
        self.exhausted = False

    async def first(self) -> AsyncIterator[bytes]:
        async for chunk in self.source:
            self.size += len(chunk)
            if self.size > _REPLAY_LIMIT:
                self.replayable = False
                self.kept.clear()
            elif self.replayable:
                self.kept.append(chunk)
            yield chunk
        self.exhausted = True

    async def again(self) -> AsyncIterator[bytes]:
        assert self.replayable
        for chunk in self.kept:
            yield chunk
        self.kept = []
        if not self.exhausted:
            async for chunk in self.source:
                yield chunk
