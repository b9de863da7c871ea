"""Bounded reads of what a guest answers the host: the one place that says how much of
envd's answers (or any guest port's) the host holds, and how it stops past that.

A guest is hostile: envd is whatever program listens on its port, and it may answer a
1 GiB body, an endless stream, or a Connect header claiming a 4 GiB message. Every answer
is read as a stream (`stream`, then `read_body` or `aiter_messages`) and refused with
`AnswerTooLargeError` once it passes the limit of its call, so the host's memory stays
flat whatever a guest sends. Limits per call, sized to what the call legitimately returns:

| limit | bytes | for |
|---|---|---|
| `MAX_ANSWER_BYTES` | 64 KiB | /init, /health, POST /files answers and every error body (empty or a short JSON error) |
| `MAX_METRICS_BYTES` | 1 MiB | GET /metrics (one JSON object of ~10 numbers, ~200 bytes; room for fields to come) |
| `MAX_MESSAGE_BYTES` | 1 MiB | one Connect envelope (envd's output events carry ≤ 64 KiB: ~88 KiB as base64 JSON); refused from its 5-byte header |
| `MAX_SYNC_STREAM_BYTES` | 1 MiB | the whole stream of the host's `/bin/sync` (start, end, end-of-stream: < 1 KiB) |
| `MAX_LINE_BYTES` | 16 KiB | one line of a build command's output (the build log keeps 16,384 characters per entry) |

A long stream (a build's RUN step) has no total limit: it is read one envelope at a time,
its output kept one bounded line at a time (and by the build log, 16 MiB at most), its
length bounded by the step's timeout.

    GuestAnswerError            an answer the host refuses to read (ValueError)
    └── AnswerTooLargeError     past its call's limit

Callers translate these at their boundary (the orchestrator: `GuestAnswerInvalid`, 502;
a template build: `GuestCommandError`, then the step's `BuildFailed`).
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from host.connect_envelope import Decoder, EnvelopeError, EnvelopeTooLargeError

KIB = 1024
MIB = 1024 * KIB

MAX_ANSWER_BYTES = 64 * KIB
MAX_METRICS_BYTES = 1 * MIB
MAX_MESSAGE_BYTES = 1 * MIB
MAX_SYNC_STREAM_BYTES = 1 * MIB
MAX_LINE_BYTES = 16 * KIB

LINE_TRUNCATED = b" [line truncated]"


# What every host `/init` carries (the orchestrator's to a sandbox, a build's to a build VM
# restored from its builder): the host's clock (a VM restored from a snapshot resumes the
# snapshot's) and fresh entropy (and its kernel RNG state: envd/entropy.py reseeds it
# first thing; `aenvEntropy` is ours alone, E2B's envd ignores unknown fields).
ENTROPY_FIELD = "aenvEntropy"
ENTROPY_BYTES = 64


def clock_and_entropy() -> dict[str, str]:
    return {"timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            ENTROPY_FIELD: secrets.token_bytes(ENTROPY_BYTES).hex()}


class GuestAnswerError(ValueError):
    """An answer from a guest that the host refuses to read: past its limit, compressed
    though the host asked for identity, or not the protocol's framing."""


class AnswerTooLargeError(GuestAnswerError):
    def __init__(self, peer: str, what: str, limit: int, *, claimed: int | None = None) -> None:
        detail = f" (it claimed {size(claimed)})" if claimed is not None else ""
        super().__init__(f"{peer} answered more than {size(limit)} for {what}{detail}")
        self.what = what
        self.limit = limit
        self.claimed = claimed


def size(n: int) -> str:
    """`n` bytes for a message: 64 KiB, 1 MiB, 1 GiB, 300 bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class Answer:
    """A whole (bounded) answer: what callers used of httpx.Response."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


@contextlib.asynccontextmanager
async def stream(client: httpx.AsyncClient, method: str, url: str,
                 **kwargs: Any) -> AsyncIterator[httpx.Response]:
    """`client.stream(...)` asking for an uncompressed answer: the limits count the bytes
    that arrive, and a gzip or zstd body would inflate past them inside httpx's decoder."""
    headers = httpx.Headers(kwargs.pop("headers", None))
    headers["Accept-Encoding"] = "identity"
    async with client.stream(method, url, headers=headers, **kwargs) as resp:
        yield resp


async def request(client: httpx.AsyncClient, method: str, url: str, *, limit: int,
                  what: str, peer: str = "envd", **kwargs: Any) -> Answer:
    """One request whose whole answer is read, at most `limit` bytes of it."""
    async with stream(client, method, url, **kwargs) as resp:
        body = await read_body(resp, limit=limit, what=what, peer=peer)
        return Answer(resp.status_code, resp.headers, body)


async def read_body(resp: httpx.Response, *, limit: int, what: str,
                    peer: str = "envd") -> bytes:
    """The body of a streamed answer, or AnswerTooLargeError once it passes `limit` (from
    its Content-Length alone when that says so: nothing of it is read then)."""
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise AnswerTooLargeError(peer, what, limit, claimed=int(declared))
    body = bytearray()
    async for chunk in _raw(resp, what, peer):
        if len(body) + len(chunk) > limit:
            raise AnswerTooLargeError(peer, what, limit)
        body += chunk
    return bytes(body)


async def aiter_messages(resp: httpx.Response, *, what: str, peer: str = "envd",
                         max_message_bytes: int = MAX_MESSAGE_BYTES,
                         max_total_bytes: int | None = None
                         ) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """(flags, message) of each Connect envelope of a streamed answer, as they arrive.
    An envelope over `max_message_bytes` is refused from its header; the stream as a
    whole, past `max_total_bytes` (None: no total, for long streams)."""
    decoder = Decoder(max_bytes=max_message_bytes)
    total = 0
    try:
        async for chunk in _raw(resp, what, peer):
            total += len(chunk)
            if max_total_bytes is not None and total > max_total_bytes:
                raise AnswerTooLargeError(peer, what, max_total_bytes)
            for item in decoder.feed(chunk):
                yield item
        decoder.close()
    except EnvelopeTooLargeError as exc:
        raise AnswerTooLargeError(peer, f"one message of {what}", exc.max_bytes,
                                  claimed=exc.length) from exc
    except EnvelopeError as exc:
        raise GuestAnswerError(f"{peer} sent a malformed stream on {what}: {exc}") from exc


async def _raw(resp: httpx.Response, what: str, peer: str) -> AsyncIterator[bytes]:
    """The body's bytes as they came: a peer that compresses anyway is refused rather
    than inflated (with no Content-Encoding, httpx's decoder passes chunks through)."""
    encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise GuestAnswerError(f"{peer} answered {what} with Content-Encoding {encoding!r}; "
                               "the host asks for identity")
    async for chunk in resp.aiter_bytes():
        yield chunk


class Lines:
    """Lines of one output stream (a build command's stdout or stderr) as its data
    arrives, each at most `max_bytes`: a longer line is cut there, marked, and the rest of
    it skipped, so a guest printing 1 GiB without a newline holds `max_bytes` here."""

    def __init__(self, *, max_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._tail = bytearray()
        self._skipping = False  # inside a line already cut: drop until its newline

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while start <= len(data):
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl]
            if not self._skipping:
                self._tail += piece[:self.max_bytes - len(self._tail) + 1]
                if len(self._tail) > self.max_bytes:
                    lines.append(bytes(self._tail[:self.max_bytes]) + LINE_TRUNCATED)
                    self._tail.clear()
                    self._skipping = True
            if nl < 0:
                break
            if not self._skipping:
                lines.append(bytes(self._tail))
            self._tail.clear()
            self._skipping = False
            start = nl + 1
        return lines

    def close(self) -> list[bytes]:
        """The stream ended: its last line, if it had no newline."""
        last = [bytes(self._tail)] if self._tail and not self._skipping else []
        self._tail.clear()
        self._skipping = False
        return last
