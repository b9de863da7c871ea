"""Helpers of the template tests: an orchestrator over the fake runtime, uploads, and a
build driven to its end."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Sequence

from host.contract import BuildStep
from host.orchestrator import NodeOrchestrator
from host.orchestrator.model import BuildRequest, BuildStart, BuildStatus, RequestedBuild

TERMINAL = ("ready", "error")


def files_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def upload(orch: NodeOrchestrator, content: bytes = b"archive") -> str:
    h = files_hash(content.decode(errors="replace") + "|upload")
    await orch.put_template_file(h, chunks(content), max_bytes=1 << 20)
    return h


def run(*cmds: str) -> tuple[BuildStep, ...]:
    return tuple(BuildStep(type="RUN", args=(c,)) for c in cmds)


async def wait_build(orch: NodeOrchestrator, template_id: str, build_id: str, *,
                     timeout_s: float = 5.0) -> BuildStatus:
    """Poll the status until ready or error; the last status (with every log entry)."""
    async with asyncio.timeout(timeout_s):
        while True:
            st = await orch.build_status(template_id, build_id, limit=100_000)
            if st.status in TERMINAL:
                return st
            await asyncio.sleep(0.005)


async def build(orch: NodeOrchestrator, name: str = "my-tpl", *,
                steps: Sequence[BuildStep] = (), from_template: str | None = "base",
                from_image: str | None = None, tags: Sequence[str] = (),
                start_cmd: str | None = None, ready_cmd: str | None = None,
                ) -> tuple[RequestedBuild, BuildStatus]:
    """Request, start and wait for one build."""
    req = await orch.request_build(BuildRequest(name=name, tags=tuple(tags)))
    await orch.start_build(req.template_id, req.build_id, BuildStart(
        from_template=None if from_image else from_template, from_image=from_image,
        steps=tuple(steps), start_cmd=start_cmd, ready_cmd=ready_cmd))
    return req, await wait_build(orch, req.template_id, req.build_id)
