"""Kernel iopub messages -> the E2B execution stream's NDJSON lines.

Every line is one JSON object with a `type` the SDKs dispatch on: `stdout` / `stderr`
(`text`, `timestamp` in Unix nanoseconds), `result` (one field per MIME type,
`is_main_result`, `extra` for MIME types without a field), `error` (`name`, `value`,
`traceback` as one string), `number_of_executions` (`execution_count`). E2B's server also
sends `keepalive` during silence and `end_of_execution` last; the SDKs ignore both.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Mapping
from typing import Any

Output = dict[str, Any]

END_OF_EXECUTION: Output = {"type": "end_of_execution"}
KEEPALIVE: Output = {"type": "keepalive"}

# MIME type -> Result field, in the order the SDKs list formats
_RESULT_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# colours some kernels (JJava, Deno) put into tracebacks: the SDKs hand them to programs
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def encode(output: Output) -> bytes:
    """One NDJSON line, pure ASCII: the JS SDK decodes each network chunk on its own, so a
    multi-byte character split across two chunks would be garbled."""
    return json.dumps(output, default=str).encode() + b"\n"


def from_iopub(msg: Mapping[str, Any]) -> Output | None:
    """The output line for one iopub message of an execution, None for bookkeeping ones
    (status, clear_output, comm traffic, ...)."""
    kind = msg.get("msg_type") or msg["header"]["msg_type"]
    content = msg.get("content") or {}
    if kind == "stream":
        name = "stderr" if content.get("name") == "stderr" else "stdout"
        return {"type": name, "text": content.get("text", ""),
                "timestamp": _timestamp_ns(msg.get("header", {}).get("date"))}
    if kind == "execute_result":
        return result(content.get("data") or {}, is_main_result=True)
    if kind == "display_data":
        return result(content.get("data") or {}, is_main_result=False)
    if kind == "error":
        return error(content.get("ename", ""), content.get("evalue", ""),
                     content.get("traceback") or [])
    if kind == "execute_input":
        return {"type": "number_of_executions",
                "execution_count": content.get("execution_count")}
    return None


def result(data: Mapping[str, Any], *, is_main_result: bool) -> Output:
    """A `result` line from a MIME bundle (execute_result or display_data)."""
    out: Output = {"type": "result"}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = _RESULT_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    if isinstance(text, str):
        out["text"] = _unquote(text)
    out["is_main_result"] = is_main_result
    out["extra"] = extra
    return out


def error(name: str, value: str, traceback: list[str] | str) -> Output:
    """An `error` line; a kernel's traceback list is joined into one plain string."""
    if not isinstance(traceback, str):
        traceback = "\n".join(line.rstrip("\n") for line in traceback)
    return {"type": "error", "name": name, "value": _ANSI.sub("", value),
            "traceback": _ANSI.sub("", traceback)}


def _unquote(text: str) -> str:
    # A str's repr as the plain text of a result: the SDKs' users expect `'a'` to give
    # text "a", as E2B's server strips one pair of matching quotes.
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _timestamp_ns(date: Any) -> int:
    if isinstance(date, str):
        try:
            date = dt.datetime.fromisoformat(date)
        except ValueError:
            date = None
    if isinstance(date, dt.datetime):
        if date.tzinfo is None:
            date = date.replace(tzinfo=dt.UTC)
        delta: dt.timedelta = date - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    return time.time_ns()
