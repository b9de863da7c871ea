"""Logging of the host service: `--log-format text` (the classic one-line format) or `json`
(one object per line: `ts`, `level`, `logger`, `msg`, and `sandbox_id` when the record
concerns a sandbox; `exc` with the traceback when there is one).

Which sandbox a record concerns comes from a context variable that the orchestrator sets
around each sandbox operation (`Metrics.operation`, `bind_sandbox` once a new sandbox has
its id), so every record logged inside the operation, at any depth (runtime, storage
client, network), carries it; failing that, from the record's arguments when one is a
sandbox id (`log.info("sandbox %s: ...", sandbox_id)`, an API path in an access log).

python-json-logger is not a dependency (nor installed here), and the format is small
enough for a 20-line `logging.Formatter`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
import sys
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import IO, Any

from host.ids import SANDBOX_ID_BODY

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# host/ids.py's SANDBOX_ID, as a whole argument or as a path segment
_SANDBOX_ID = re.compile(rf"(?:^|/)({SANDBOX_ID_BODY})(?:$|[/?])")

_sandbox: ContextVar[str | None] = ContextVar("aenv_sandbox_id", default=None)


def bind_sandbox(sandbox_id: str | None) -> Token[str | None]:
    """From now on (in this task and the tasks it starts) records concern `sandbox_id`."""
    return _sandbox.set(sandbox_id)


def current_sandbox() -> str | None:
    return _sandbox.get()


@contextlib.contextmanager
def sandbox_context(sandbox_id: str | None) -> Iterator[None]:
    """Records inside the block concern `sandbox_id` (None: whichever they concerned
    already); what `bind_sandbox` set inside is undone on the way out too."""
    token = _sandbox.set(sandbox_id if sandbox_id is not None else _sandbox.get())
    try:
        yield
    finally:
        _sandbox.reset(token)


def _sandbox_in_args(args: Any) -> str | None:
    values = args.values() if isinstance(args, dict) else args if isinstance(args, tuple) else ()
    for value in values:
        if isinstance(value, str) and (m := _SANDBOX_ID.search(value)):
            return m.group(1)
    return None


class SandboxIdFilter(logging.Filter):
    """Sets `record.sandbox_id` (None when the record concerns no sandbox). On a handler,
    it sees every record the handler writes, whichever logger made it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "sandbox_id", None) is None:  # else given with extra=
            record.sandbox_id = _sandbox.get() or _sandbox_in_args(record.args)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, RFC 3339, ms), level, logger, msg, sandbox_id,
    exc (the formatted traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        doc: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        sandbox_id = getattr(record, "sandbox_id", None)
        if sandbox_id:
            doc["sandbox_id"] = sandbox_id
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def setup_logging(level: str, log_format: str = "text", *,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Log to `stream` (stderr) at `level` in `log_format`; returns the root's new handler.
    With "json", run uvicorn with `log_config=None` so its loggers reach this handler."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(SandboxIdFilter())
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
