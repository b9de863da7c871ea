"""Reusable wire types of the REST API models (models.py).

Each type carries both its validation and its JSON schema, so that the OpenAPI document
(openapi.py) says exactly what validation accepts: bounded integers, fields where null means
absent, and the codecs of query strings (comma lists, the double-encoded `metadata` filter,
RFC 3339 times, opaque page cursors).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, TypeVar
from urllib.parse import unquote

from pydantic import BeforeValidator, GetCoreSchemaHandler, GetJsonSchemaHandler, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

T = TypeVar("T")

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# The error type of the checks below; validation.py prints it as "'<field>' <message>".
WIRE_ERROR = "wire"


def wire_error(template: str, **ctx: object) -> PydanticCustomError:
    """A validation error whose message completes "'<field>' ..."; values go in `ctx`
    (the template is formatted by pydantic, so user input must never be part of it)."""
    return PydanticCustomError(WIRE_ERROR, template, ctx)


@dataclass(frozen=True)
class Between:
    """`Annotated[int, Between(lo, hi)]`: lo <= value <= hi, with one message naming both
    bounds; documented as minimum/maximum (and `fmt`, e.g. int32, as the format)."""

    lo: int
    hi: int
    fmt: str | None = None

    def __get_pydantic_core_schema__(self, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        out.update(minimum=self.lo, maximum=self.hi)
        if self.fmt:
            out["format"] = self.fmt
        return out

    def _check(self, value: int) -> int:
        if not self.lo <= value <= self.hi:
            raise wire_error("must be between {lo} and {hi}, got {value}",
                             lo=self.lo, hi=self.hi, value=value)
        return value


class _NullInSchema:
    """Documents null as accepted. Request models drop null members before validation
    (models.RequestModel), so the field then takes its default: null == absent."""

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"anyOf": [handler(schema), {"type": "null"}]}


# `x: Nullable[int] = 5`: null on the wire reads as absent (5), and x is never None.
Nullable = Annotated[T, _NullInSchema()]

Seconds = Annotated[int, Between(0, INT32_MAX, "int32")]
Count64 = Annotated[int, Between(0, INT64_MAX, "int64")]   # unix seconds or ms, offsets


# --- query-string codecs --------------------------------------------------------------

def _comma_list(raw: object) -> object:
    """`a,b` -> [a, b]: both SDKs join array query values with commas. Items are taken as
    they are (a blank or padded item is checked like any other, and fails an enum)."""
    return raw.split(",") if isinstance(raw, str) else raw


# An array query parameter sent as one comma-joined value (style form, explode false).
CommaList = Annotated[list[T] | None, BeforeValidator(_comma_list)]


def _metadata_filter(raw: object) -> object:
    """Decode the double-encoded `metadata` param exactly like upstream `parseFilters`.

    (1) normal query decoding already happened; (2) unquote the whole string; (3) split on
    `&` and `=`; (4) unquote each key and value.
    """
    if not isinstance(raw, str):
        return raw
    out: dict[str, str] = {}
    for pair in unquote(raw).split("&"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise wire_error("must be key=value pairs, got {pair}", pair=repr(pair))
        out[unquote(key)] = unquote(value)
    return out


MetadataFilter = Annotated[dict[str, str], BeforeValidator(_metadata_filter), WithJsonSchema({
    "type": "string",
    "description": "url-encoded key=value pairs joined by '&' (keys and values encoded once "
                   "more); every pair must match"})]


def _rfc3339(raw: object) -> object:
    if not isinstance(raw, str):
        return raw
    try:
        dt = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError:
        raise wire_error("must be an RFC 3339 date-time, got {got}", got=repr(raw)) from None
    if dt.tzinfo is None:
        raise wire_error("must carry a time zone offset, got {got}", got=repr(raw))
    return dt


# An RFC 3339 date-time with an offset (Py sends local-tz `isoformat()`).
Rfc3339 = Annotated[datetime, BeforeValidator(_rfc3339)]


def encode_cursor(sort_key: float, ident: str) -> str:
    """The opaque `X-Next-Token`: where the next page starts."""
    raw = json.dumps([sort_key, ident], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(token: object) -> object:
    if not isinstance(token, str):
        return token
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        key, ident = json.loads(raw)
        if isinstance(key, bool) or not isinstance(key, (int, float)) or not isinstance(ident, str):
            raise TypeError("bad cursor shape")
    except (binascii.Error, ValueError, TypeError):
        raise wire_error("must be the X-Next-Token of the previous page") from None
    return float(key), ident


Cursor = Annotated[tuple[float, str], BeforeValidator(_decode_cursor), WithJsonSchema({
    "type": "string", "description": "X-Next-Token of the previous page (opaque)"})]
