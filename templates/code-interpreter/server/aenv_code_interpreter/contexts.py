"""Contexts: one kernel each, its execution queue and worker; the registry of them all.

A context runs its jobs one at a time, in order, on a worker task it owns. Restarting
a context (the API call, or the worker finding its kernel dead) ends the running job
with a `ContextRestarting` error, replaces the kernel process and keeps the queue. The
registry also keeps one default context per language, created on first use (the python
one at startup), for executions that name a language or nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import uuid
from pathlib import Path

from . import outputs
from .errors import ContextNotFoundError, KernelDiedError, KernelError, RequestError
from .execution import EnvState, Job, run_job
from .kernel import Kernel
from .languages import DEFAULT_LANGUAGE, LANGUAGES
from .models import ContextInfo
from .settings import Settings

log = logging.getLogger(__name__)


class Context:
    """A kernel with a FIFO of jobs; `start`, `submit`, `restart`, `aclose`."""

    def __init__(self, language: str, cwd: str, *, runtime_dir: Path,
                 settings: Settings) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self._settings = settings
        self._kernel = Kernel(self.id, LANGUAGES[language], cwd=cwd, runtime_dir=runtime_dir,
                              ready_timeout_s=settings.kernel_ready_timeout_s)
        self._jobs: asyncio.Queue[Job] = asyncio.Queue()
        self._env = EnvState()
        self._worker: asyncio.Task[None] | None = None
        self._stop_reason = "Context was restarted"   # the error a stopped worker's job gets
        self._closed = False
        self._lifecycle = asyncio.Lock()   # restart / close never interleave

    def info(self) -> ContextInfo:
        return ContextInfo(id=self.id, language=self.language, cwd=self.cwd)

    async def start(self, *, kernel: bool = True) -> None:
        """Start the worker, and the kernel now (KernelError if it cannot start) or, with
        `kernel=False`, when the first job comes."""
        if kernel:
            await self._start_kernel()
        self._start_worker()

    async def _start_kernel(self) -> None:
        try:
            await self._kernel.start()
        except BaseException:
            await self._kernel.shutdown()
            raise

    def submit(self, job: Job) -> None:
        """Queue `job`; it runs after every job queued before it."""
        if self._closed:
            raise ContextNotFoundError(self.id)
        self._jobs.put_nowait(job)

    async def restart(self) -> None:
        """A fresh kernel (state lost); the running job ends with an error."""
        async with self._lifecycle:
            await self._stop_worker("Context was restarted")
            self._env = EnvState()
            try:
                if self._kernel.started:     # a kernel never started has no state to lose
                    await self._kernel.restart()
            finally:
                # even with a failed restart: the worker's next job retries it
                if not self._closed:
                    self._start_worker()

    async def aclose(self) -> None:
        """Stop the worker, end queued jobs, kill the kernel; idempotent."""
        self._closed = True
        async with self._lifecycle:
            await self._stop_worker("Context was removed")
            while not self._jobs.empty():
                job = self._jobs.get_nowait()
                if job.claim():
                    job.finish(outputs.error("ContextRestarting", "Context was removed", ""))
            await self._kernel.shutdown()

    def _start_worker(self) -> None:
        self._worker = asyncio.create_task(self._work(), name=f"context-{self.id}")

    async def _stop_worker(self, reason: str) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            self._stop_reason = reason
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            if (task := asyncio.current_task()) is not None and task.cancelling():
                raise asyncio.CancelledError

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            if not job.claim():
                continue    # its client left while it waited
            try:
                if not self._kernel.started:
                    await self._start_kernel()
                await run_job(self._kernel, job, self._env, self._settings)
            except asyncio.CancelledError:
                job.finish(outputs.error("ContextRestarting", self._stop_reason, ""))
                raise
            except KernelDiedError as exc:
                log.warning("context %s: %s; restarting it", self.id, exc)
                job.finish(outputs.error(
                    "ContextRestarting",
                    f"The kernel died (exit code {exc.exit_code}) and the context was "
                    "restarted; its state (variables, imports) is lost", ""))
                await self._recover()
            except KernelError as exc:
                log.error("context %s: %s", self.id, exc)
                job.finish(outputs.error("KernelError", str(exc), ""))
                if self._kernel.started:
                    await self._recover()
            except Exception as exc:   # a bug here must not leave later jobs waiting
                log.exception("context %s: execution failed", self.id)
                job.finish(outputs.error("InternalError", repr(exc), ""))
            finally:
                job.finish()

    async def _recover(self) -> None:
        # runs on the worker itself, so it restarts the kernel without stopping the worker
        self._env = EnvState()
        try:
            await self._kernel.restart()
        except KernelError as exc:
            log.error("context %s: restart failed: %s", self.id, exc)


class ContextRegistry:
    """Every context by id, and the default context of each language."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, str] = {}
        self._defaults_lock = asyncio.Lock()
        self._runtime_dir = Path(tempfile.mkdtemp(prefix="aenv-ci-"))  # 0700, IPC sockets

    async def create(self, language: str, cwd: str | None = None, *,
                     start: bool = True) -> Context:
        """A new context, its kernel started unless `start` is false (then on its first
        job); RequestError if `cwd` is not a directory."""
        cwd = cwd or self._settings.default_cwd
        if not Path(cwd).is_dir():
            raise RequestError(f"cwd {cwd!r} is not a directory")
        context = Context(language, cwd, runtime_dir=self._runtime_dir,
                          settings=self._settings)
        await context.start(kernel=start)
        self._contexts[context.id] = context
        return context

    async def default(self, language: str = DEFAULT_LANGUAGE, *,
                      start: bool = True) -> Context:
        """The default context of `language`, created if missing (or removed); its
        kernel starts now, or with `start=False` on its first job."""
        async with self._defaults_lock:
            context = self._contexts.get(self._defaults.get(language, ""))
            if context is None:
                context = await self.create(language, start=start)
                self._defaults[language] = context.id
            return context

    def get(self, context_id: str) -> Context:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise ContextNotFoundError(context_id) from None

    def list(self) -> list[ContextInfo]:
        return [c.info() for c in self._contexts.values()]

    async def remove(self, context_id: str) -> None:
        context = self._contexts.pop(context_id, None)
        if context is None:
            raise ContextNotFoundError(context_id)
        await context.aclose()

    async def restart(self, context_id: str) -> None:
        await self.get(context_id).restart()

    async def aclose(self) -> None:
        """Close every context (errors are logged, not raised), then the runtime dir."""
        contexts, self._contexts = list(self._contexts.values()), {}
        results = await asyncio.gather(*(c.aclose() for c in contexts), return_exceptions=True)
        for context, result in zip(contexts, results, strict=True):
            if isinstance(result, BaseException):
                log.error("closing context %s: %s", context.id, result)
        shutil.rmtree(self._runtime_dir, ignore_errors=True)
