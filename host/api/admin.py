"""Node administration endpoints (aenv extensions, behind the API key): one run of the
node's collector, or a dry run of it (`aenv gc`, host/orchestrator/collector.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from . import models as m
from .sandboxes import orch, reply


class GcQuery(m.QueryModel):
    dry_run: bool = Field(default=False, alias="dryRun",
                          description="count what would be removed; remove nothing")


class GcReport(m.WireModel):
    """Per kind of record, how many went; per kind of storage (layers, memory, and their
    repository copies where the node owns its repository), {files, bytes, digests}; `held`:
    bytes on disk by kind after the run."""

    records: dict[str, int]
    storage: dict[str, Any]
    dry_run: bool = Field(alias="dryRun")
    seconds: float


async def collect(request: Request, *, query: GcQuery) -> Response:
    report = await orch(request).collect(dry_run=query.dry_run)
    return reply(GcReport.model_validate({**report, "dryRun": report["dry_run"]}))
