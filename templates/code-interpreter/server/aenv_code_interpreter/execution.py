"""One execution: the job a request queues, and running it against a kernel.

A `Job` is what `POST /execute` queues on a context and streams back: its outputs go
through an unbounded queue (ipykernel already coalesces stream output into a few
messages a second, and the HTTP side drains it at network speed; a bound would have to
drop output or stall the kernel reader). The context's worker runs one job at a time via
`run_job`. When the client goes away the job is cancelled: a queued job is skipped, a
running one makes the worker interrupt the kernel (and again every interrupt_retry_s)
until the kernel is idle, so the next queued execution starts right after.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import envs, outputs
from .errors import KernelDiedError
from .kernel import Kernel
from .settings import Settings

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"   # the client left before the job started: never runs


@dataclass(eq=False)
class Job:
    """An execution request between its HTTP response and the context's worker."""

    code: str
    env_vars: Mapping[str, str]
    access_token: str | None = None
    state: JobState = JobState.QUEUED
    cancel_requested: bool = False
    _queue: asyncio.Queue[outputs.Output | None] = field(default_factory=asyncio.Queue)

    def claim(self) -> bool:
        """QUEUED -> RUNNING for the worker; False if the job was cancelled meanwhile."""
        if self.state is not JobState.QUEUED:
            return False
        self.state = JobState.RUNNING
        return True

    def emit(self, output: outputs.Output) -> None:
        if not self.cancel_requested and self.state is JobState.RUNNING:
            self._queue.put_nowait(output)

    def finish(self, output: outputs.Output | None = None) -> None:
        """End the stream, after `output` if given; idempotent."""
        if self.state is JobState.RUNNING:
            if output is not None:
                self.emit(output)
            self.state = JobState.DONE
            self._queue.put_nowait(None)

    def cancel(self) -> None:
        """The client is gone: skip the job if queued, else ask the worker to interrupt."""
        self.cancel_requested = True
        if self.state is JobState.QUEUED:
            self.state = JobState.CANCELLED

    async def lines(self, keepalive_s: float) -> AsyncIterator[bytes]:
        """The NDJSON stream of this job, ending with `end_of_execution`."""
        while True:
            try:
                item = await asyncio.wait_for(self._queue.get(), keepalive_s)
            except TimeoutError:
                yield outputs.encode(outputs.KEEPALIVE)
                continue
            if item is None:
                yield outputs.encode(outputs.END_OF_EXECUTION)
                return
            yield outputs.encode(item)


@dataclass
class EnvState:
    """Sandbox-wide variables a kernel has been given (reset when the kernel restarts)."""

    applied: dict[str, str] = field(default_factory=dict)


async def run_job(kernel: Kernel, job: Job, env_state: EnvState, settings: Settings) -> None:
    """Run a claimed job: env setup, the code with its outputs streamed, `finish`, then the
    per-run env vars undone. Raises KernelDiedError if the kernel exits meanwhile (the
    caller then finishes the job with an error)."""
    lang = kernel.language
    sandbox = await envs.fetch_sandbox_envs(settings.envd_url, job.access_token,
                                            settings.envd_timeout_s)
    setup = ""
    if sandbox is not None:
        setup = envs.apply_code(lang, *envs.sandbox_env_changes(env_state.applied, sandbox))
    snapshot_wanted = lang.snapshots and bool(job.env_vars)
    reply = None
    if setup or snapshot_wanted:
        expressions = ({envs.SNAPSHOT_KEY: envs.snapshot_expression(job.env_vars)}
                       if snapshot_wanted else None)
        reply = await _run_silent(kernel, setup, settings, expressions)
    if sandbox is not None:
        env_state.applied = dict(sandbox)
    restore = ""
    if job.env_vars:
        if snapshot_wanted:
            snapshot = envs.parse_snapshot(reply)
            restore = envs.restore_code(lang, snapshot) if snapshot else ""
        else:
            restore = envs.reset_code(lang, job.env_vars, env_state.applied)
        await _run_silent(kernel, envs.apply_code(lang, job.env_vars), settings)
    if not job.cancel_requested:
        await _run_code(kernel, job, settings)
    job.finish()
    if restore:
        await _run_silent(kernel, restore, settings)


async def _run_code(kernel: Kernel, job: Job, settings: Settings) -> None:
    msg_id = kernel.execute(job.code)
    errored = False

    def emit(output: outputs.Output) -> None:
        nonlocal errored
        if output["type"] == "error":
            if errored:
                return
            errored = True
        job.emit(output)

    await _wait_idle(kernel, msg_id, settings, emit, job)
    if kernel.language.flush is not None:
        await _flush(kernel, msg_id, settings, emit)
    reply = await kernel.reply(msg_id, settings.reply_timeout_s)
    content = (reply or {}).get("content") or {}
    status = content.get("status")
    if status == "error":
        emit(outputs.error(content.get("ename", ""), content.get("evalue", ""),
                           content.get("traceback") or []))
    elif status in ("aborted", "abort"):   # IRkernel says "abort"
        emit(outputs.error("ExecutionAborted", "Execution was aborted", ""))


async def _run_silent(kernel: Kernel, code: str, settings: Settings,
                      expressions: Mapping[str, str] | None = None) -> Mapping[str, Any] | None:
    """Run bookkeeping code (no history, no outputs); the reply's content."""
    msg_id = kernel.execute(code, silent=True, user_expressions=expressions)
    errors: list[outputs.Output] = []

    def keep_errors(output: outputs.Output) -> None:
        if output["type"] == "error":
            errors.append(output)

    await _wait_idle(kernel, msg_id, settings, keep_errors)
    if errors:
        log.warning("kernel %s: env setup failed: %s", kernel.id, errors[0].get("value"))
    reply = await kernel.reply(msg_id, settings.reply_timeout_s)
    return None if reply is None else reply.get("content")


async def _next_message(kernel: Kernel, settings: Settings) -> dict[str, Any] | None:
    """The next iopub message, or None after a quiet poll interval; KernelDiedError if
    the kernel process exited meanwhile."""
    msg = await kernel.next_iopub(settings.poll_interval_s)
    if msg is None and (code := await kernel.exit_code()) is not None:
        raise KernelDiedError(code)
    return msg


async def _wait_idle(kernel: Kernel, msg_id: str, settings: Settings,
                     emit: Callable[[outputs.Output], None], job: Job | None = None) -> None:
    """Pass the outputs of request `msg_id` to `emit` until the kernel reports idle for
    it; interrupt while `job` is cancelled; KernelDiedError if the process exits."""
    interrupted_at: float | None = None
    while True:
        if job is not None and job.cancel_requested:
            now = time.monotonic()
            if interrupted_at is None or now - interrupted_at >= settings.interrupt_retry_s:
                log.info("kernel %s: client gone, interrupting", kernel.id)
                interrupted_at = now
                await kernel.interrupt()
        msg = await _next_message(kernel, settings)
        if msg is None:
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue   # late output of an interrupted or earlier request
        kind = msg.get("msg_type")
        if kind == "status":
            if msg["content"].get("execution_state") == "idle":
                return
            continue
        output = outputs.from_iopub(msg)
        if output is not None:
            emit(output)


async def _flush(kernel: Kernel, msg_id: str, settings: Settings,
                 emit: Callable[[outputs.Output], None]) -> None:
    """For a kernel that publishes outputs after `idle` (languages.Language.flush): run
    the silent flush cell and pass on what request `msg_id` still publishes until the
    cell's markers have come back through every output path. Output the kernel parents
    to the flush cell is late output of `msg_id` (Deno parents output to the request it
    last received) and passes on too; the markers do not."""
    flush = kernel.language.flush
    assert flush is not None
    marker = f"\x01aenv-flush-{uuid.uuid4().hex}"
    flush_id = kernel.execute(flush(marker), silent=True)
    stream_seen = display_seen = idle = False
    deadline = time.monotonic() + settings.flush_timeout_s
    while not (stream_seen and display_seen and idle):
        if time.monotonic() > deadline:
            log.warning("kernel %s: flush markers not back after %.0f s; the execution ends "
                        "without them", kernel.id, settings.flush_timeout_s)
            return
        msg = await _next_message(kernel, settings)
        if msg is None:
            continue
        parent = msg.get("parent_header", {}).get("msg_id")
        if parent not in (msg_id, flush_id):
            continue
        kind = msg.get("msg_type")
        content = msg.get("content") or {}
        if kind == "status":
            idle = idle or (parent == flush_id and content.get("execution_state") == "idle")
            continue
        if kind == "stream" and marker in content.get("text", ""):
            stream_seen = True
            text = content["text"].replace(f"{marker}\n", "").replace(marker, "")
            if not text:
                continue
            msg = {**msg, "content": {**content, "text": text}}
        elif kind == "display_data" and (content.get("data") or {}).get("text/plain") == marker:
            display_seen = True
            continue
        output = outputs.from_iopub(msg)
        if output is not None and output["type"] != "number_of_executions":
            emit(output)
