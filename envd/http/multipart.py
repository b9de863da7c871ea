"""Streaming `multipart/form-data` for POST /files, keeping part filenames verbatim.

The body is parsed by python-multipart's low-level callback parser
(`python_multipart.MultipartParser`): it finds boundaries and header lines and hands
over part bytes as they arrive, so a part streams straight into its destination temp
file. Its higher-level helpers are not used: `FormParser` spools parts to temp files,
and `parse_options_header` drops RFC 5987 `filename*` values and reduces Windows-style
paths to a basename, while upload part filenames are full destination paths
(`/home/user/a.txt`). Header parameters are parsed with the standard library's
`email.message` instead, which keeps them whole.
"""

from __future__ import annotations

import email.message
import email.utils
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import python_multipart
from python_multipart.exceptions import FormParserError

# Per header line of a part (a Content-Disposition with a PATH_MAX filename fits).
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADER_COUNT = 16


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


def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """`form-data; name="file"; filename="/a b"` → ("form-data", {"name": ..., ...}).

    Quoted strings are unescaped (`\\"` → `"`); RFC 5987 `key*=utf-8''%2F..` values
    are decoded and win over the plain `key`.
    """
    header = email.message.Message()
    header["value"] = value
    (kind, _), *rest = header.get_params(header="value") or [("", "")]
    params: dict[str, str] = {}
    extended: set[str] = set()
    for key, raw in rest:
        key = key.lower()
        if isinstance(raw, tuple):  # RFC 2231/5987: (charset, language, %-decoded value)
            params[key] = email.utils.collapse_rfc2231_value(raw)
            extended.add(key)
        elif key not in extended:
            params[key] = raw
    return kind.strip().lower(), params


def _decode_header(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


class MultipartParser:
    """Incremental parser: `feed(chunk)` returns events; `close()` checks completeness."""

    def __init__(self, boundary: str) -> None:
        self._events: list[Event] = []
        self._headers: dict[str, str] = {}
        self._field = bytearray()
        self._value = bytearray()
        self._done = False
        callbacks: dict[str, Callable[..., Any]] = {
            "on_part_begin": self._on_part_begin,
            "on_header_field": self._on_header_field,
            "on_header_value": self._on_header_value,
            "on_header_end": self._on_header_end,
            "on_headers_finished": self._on_headers_finished,
            "on_part_data": self._on_part_data,
            "on_part_end": self._on_part_end,
            "on_end": self._on_end,
        }
        try:
            if not boundary:
                raise MultipartError("empty multipart boundary")
            self._parser = python_multipart.MultipartParser(
                boundary.encode("latin-1"), callbacks,  # type: ignore[arg-type]
                max_header_count=MAX_HEADER_COUNT, max_header_size=MAX_HEADER_BYTES)
        except (FormParserError, UnicodeEncodeError):
            raise MultipartError("invalid multipart boundary") from None

    @property
    def done(self) -> bool:
        return self._done

    def feed(self, chunk: bytes) -> list[Event]:
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise MultipartError(str(exc)) from None
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        if not self._done:
            raise MultipartError("multipart body ended before the closing boundary")

    # -- python-multipart callbacks ------------------------------------------------
    def _on_part_begin(self) -> None:
        self._headers = {}

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _on_header_end(self) -> None:
        name = _decode_header(bytes(self._field)).strip().lower()
        self._headers[name] = _decode_header(bytes(self._value)).strip()
        self._field.clear()
        self._value.clear()

    def _on_headers_finished(self) -> None:
        part = PartStart(headers=self._headers)
        disposition = part.headers.get("content-disposition")
        if disposition is not None:
            kind, params = parse_header_params(disposition)
            if kind != "form-data":
                raise MultipartError(f"unexpected content disposition '{kind}'")
            part.name = params.get("name")
            part.filename = params.get("filename")
        self._events.append(part)

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        self._events.append(PartData(data[start:end]))

    def _on_part_end(self) -> None:
        self._events.append(PartEnd())

    def _on_end(self) -> None:
        self._done = True
