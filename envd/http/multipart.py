"""Streaming `multipart/form-data` parser that keeps part filenames verbatim.

Upload part filenames are full destination paths (`/home/user/a.txt`); generic
parsers may reduce them to a basename, and starlette's form parsing buffers parts
in spooled temp files. This one is fed raw body chunks and emits events as soon as
bytes arrive, so a part streams straight into its destination temp file.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from enum import Enum

MAX_HEADER_BYTES = 16 * 1024


class MultipartError(ValueError):
    """The body is not well-formed multipart (maps to 400)."""


@dataclass
class PartStart:
    headers: dict[str, str] = field(default_factory=dict)
    name: str | None = None
    filename: str | None = None


@dataclass
class PartData:
    data: bytes


@dataclass
class PartEnd:
    pass


Event = PartStart | PartData | PartEnd

_PARAM = re.compile(r';\s*([^\s=;]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """`form-data; name="file"; filename="/a b"` → ("form-data", {"name": ..., ...}).

    Quoted strings are unescaped (`\\"` → `"`); RFC 5987 `key*=utf-8''%2F..` values
    are decoded and win over the plain `key`.
    """
    main, _, rest = value.partition(";")
    params: dict[str, str] = {}
    extended: dict[str, str] = {}
    for m in _PARAM.finditer(";" + rest):
        key, raw = m.group(1).lower(), m.group(2).strip()
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = re.sub(r"\\(.)", r"\1", raw[1:-1])
        if key.endswith("*"):
            charset, _, encoded = raw.partition("'")
            _, _, encoded = encoded.partition("'")
            try:
                extended[key[:-1]] = urllib.parse.unquote(encoded, encoding=charset or "utf-8",
                                                          errors="strict")
            except (LookupError, UnicodeDecodeError):
                raise MultipartError(f"bad extended parameter {key}") from None
        else:
            params[key] = raw
    params.update(extended)
    return main.strip().lower(), params


def _decode_header(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


class _State(Enum):
    PREAMBLE = 1
    AFTER_BOUNDARY = 2
    HEADERS = 3
    BODY = 4
    DONE = 5


class MultipartParser:
    """Incremental parser: `feed(chunk)` returns events; `close()` checks completeness."""

    def __init__(self, boundary: str) -> None:
        if not boundary or len(boundary) > 200:
            raise MultipartError("invalid multipart boundary")
        self._delimiter = b"--" + boundary.encode("latin-1")
        self._body_marker = b"\r\n" + self._delimiter
        self._buf = b""
        self._state = _State.PREAMBLE

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def feed(self, chunk: bytes) -> list[Event]:
        self._buf += chunk
        events: list[Event] = []
        while True:
            progressed = self._step(events)
            if not progressed:
                return events

    def close(self) -> None:
        if self._state is not _State.DONE:
            raise MultipartError("multipart body ended before the closing boundary")

    def _step(self, events: list[Event]) -> bool:
        buf = self._buf
        if self._state is _State.PREAMBLE:
            idx = buf.find(self._delimiter)
            if idx < 0:
                self._buf = buf[-len(self._delimiter):]
                return False
            self._buf = buf[idx + len(self._delimiter):]
            self._state = _State.AFTER_BOUNDARY
            return True
        if self._state is _State.AFTER_BOUNDARY:
            stripped = buf.lstrip(b" \t")  # transport padding
            if len(stripped) < 2:
                return False
            if stripped.startswith(b"--"):
                self._state, self._buf = _State.DONE, b""
                return False
            if not stripped.startswith(b"\r\n"):
                raise MultipartError("malformed multipart boundary line")
            self._buf = stripped[2:]
            self._state = _State.HEADERS
            return True
        if self._state is _State.HEADERS:
            if buf.startswith(b"\r\n"):
                head, self._buf = b"", buf[2:]
            else:
                idx = buf.find(b"\r\n\r\n")
                if idx < 0:
                    if len(buf) > MAX_HEADER_BYTES:
                        raise MultipartError("multipart part headers too large")
                    return False
                head, self._buf = buf[:idx], buf[idx + 4:]
            events.append(self._part_start(head))
            self._state = _State.BODY
            return True
        if self._state is _State.BODY:
            idx = buf.find(self._body_marker)
            if idx < 0:
                keep = len(self._body_marker) - 1
                if len(buf) > keep:
                    events.append(PartData(buf[:-keep]))
                    self._buf = buf[-keep:]
                return False
            if idx:
                events.append(PartData(buf[:idx]))
            events.append(PartEnd())
            self._buf = buf[idx + len(self._body_marker):]
            self._state = _State.AFTER_BOUNDARY
            return True
        self._buf = b""  # DONE: ignore the epilogue
        return False

    @staticmethod
    def _part_start(head: bytes) -> PartStart:
        part = PartStart()
        for line in head.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise MultipartError("malformed multipart part header")
            part.headers[_decode_header(name).strip().lower()] = _decode_header(value).strip()
        disposition = part.headers.get("content-disposition")
        if disposition is not None:
            kind, params = parse_header_params(disposition)
            if kind != "form-data":
                raise MultipartError(f"unexpected content disposition '{kind}'")
            part.name = params.get("name")
            part.filename = params.get("filename")
        return part
