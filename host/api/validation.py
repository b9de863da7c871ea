"""Reading a request into its declared models, and pydantic's errors into one 400 message.

Bodies are validated strictly (JSON types as declared: no "60" for 60, no true for 1);
query strings and headers are text, validated lax ("60" is 60). Every failure raises
`ApiError(400, ...)` naming the failing field, e.g. `'timeout' must be an integer, got str`.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from .errors import bad_request
from .types import WIRE_ERROR

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M], *, required: bool = True) -> M:
    """The JSON object body as `model`; an empty body is `{}` unless `required` (a blank
    one is not JSON: the document says "no body or an object")."""
    raw = await request.body()
    data: Any = {}
    if raw:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise bad_request(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise bad_request("request body must be a JSON object")
    elif required:
        raise bad_request("request body is required")
    return validate(model, data, strict=True)


def read_query(request: Request, model: type[M]) -> M:
    """The query string as `model` (a repeated parameter: its last value)."""
    return validate(model, dict(request.query_params), strict=False)


def read_headers(request: Request, model: type[M]) -> M:
    """The headers `model` declares (by wire name, any case)."""
    names = [f.alias or name for name, f in model.model_fields.items()]
    data = {n: request.headers[n] for n in names if n in request.headers}
    return validate(model, data, strict=False)


def validate(model: type[M], data: Any, *, strict: bool) -> M:
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as exc:
        raise bad_request(message(exc)) from exc


# --- messages -------------------------------------------------------------------------

_A = {
    "int": "must be an integer", "float": "must be a number", "string": "must be a string",
    "bool": "must be a boolean", "dict": "must be an object", "model": "must be an object",
    "model_attributes": "must be an object", "list": "must be an array",
    "datetime": "must be an RFC 3339 date-time",
}
# pydantic error type -> the rest of "'<field>' ..."
_PHRASES: dict[str, str] = {
    **{f"{t}_type": p for t, p in _A.items()},
    **{f"{t}_parsing": p for t, p in _A.items()},
    "int_from_float": "must be an integer",
    "missing": "is required",
    "string_too_short": "must not be empty",
    "string_too_long": "must be at most {max_length} characters",
    "string_pattern_mismatch": "must match {pattern}",
    "too_long": "must have at most {max_length} items",
    "literal_error": "must be {expected}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
}


def _json_type(value: object) -> str:
    return "null" if value is None else type(value).__name__


def field_name(loc: tuple[int | str, ...]) -> str:
    """('network', 'allowOut', 0) -> network.allowOut[0]"""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def describe(err: ErrorDetails) -> str:
    """One error as "'<field>' <what is wrong>"."""
    field = field_name(err["loc"]) or "request body"
    kind = err["type"]
    if kind == WIRE_ERROR:
        return f"'{field}' {err['msg']}"
    if kind == "too_long" and err.get("ctx", {}).get("max_length") == 0:
        return f"'{field}' must be empty (not supported by this server)"
    phrase = _PHRASES.get(kind)
    if phrase is None:
        return f"'{field}': {err['msg']}"
    text = f"'{field}' {phrase.format(**err.get('ctx', {}))}"
    if kind.endswith(("_type", "_parsing", "_from_float")):
        text += f", got {_json_type(err['input'])}"
    elif kind in ("literal_error", "greater_than_equal", "less_than_equal"):
        text += f", got {err['input']!r}"
    return text


def message(exc: ValidationError) -> str:
    """Every error of `exc`, each naming its field."""
    return "; ".join(describe(e) for e in exc.errors(include_url=False))
