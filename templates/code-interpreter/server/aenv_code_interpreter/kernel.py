"""One kernel process and the client talking to it (jupyter_client, asyncio API).

Kernels are started from a spec built here from the context's `Language` rather than one
found on disk: the guest needs no installed kernelspec, and a python kernel runs on
`sys.executable`, so it always matches the server's packages. Connection files (and IPC
sockets, for the kernels that can use them) live in the registry's private runtime
directory, never in $HOME; the other kernels listen on loopback TCP only.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from .errors import KernelError
from .languages import Language

Message = dict[str, Any]


class _LanguageSpecs(KernelSpecManager):
    """Resolves the kernel name to the spec of one language (its argv is looked up when
    the kernel starts, so a missing runtime is a KernelError then, not at import)."""

    def __init__(self, language: Language) -> None:
        super().__init__()
        self._language = language

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        lang = self._language
        return KernelSpec(argv=lang.argv(), display_name=lang.display_name,
                          language=lang.name, interrupt_mode=lang.interrupt_mode,
                          env=dict(lang.env), metadata={})


@contextlib.contextmanager
def _mapped(action: str, kernel_id: str) -> Iterator[None]:
    """jupyter_client / zmq failures -> KernelError (cancellation passes through)."""
    try:
        yield
    except KernelError:
        raise
    except Exception as exc:  # jupyter_client raises RuntimeError, TimeoutError, zmq errors
        raise KernelError(f"cannot {action} kernel {kernel_id}: {exc}") from exc


class Kernel:
    """A kernel process with its channels open; `start`, `restart`, `shutdown`."""

    def __init__(self, kernel_id: str, language: Language, *, cwd: str, runtime_dir: Path,
                 ready_timeout_s: float) -> None:
        self.id = kernel_id
        self.language = language
        self.cwd = cwd
        self._ready_timeout_s = ready_timeout_s
        ip = str(runtime_dir / kernel_id) if language.transport == "ipc" else "127.0.0.1"
        self._manager = AsyncKernelManager(
            kernel_name=language.name, kernel_spec_manager=_LanguageSpecs(language),
            transport=language.transport, ip=ip,
            connection_file=str(runtime_dir / f"{kernel_id}.json"))
        self._client: AsyncKernelClient | None = None

    @property
    def started(self) -> bool:
        """Whether the process runs with its channels open (started, not shut down)."""
        return self._client is not None

    async def start(self) -> None:
        """Launch the process and wait for its kernel_info reply."""
        # the server's own settings are no business of user code
        env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_CI_")}
        with _mapped("start", self.id):
            await self._manager.start_kernel(cwd=self.cwd, env=env)
        await self._connect()

    async def restart(self) -> None:
        """Kill the process and start a fresh one (same cwd, same sockets)."""
        self._disconnect()
        with _mapped("restart", self.id):
            await self._manager.restart_kernel(now=True)
        await self._connect()

    async def shutdown(self) -> None:
        """Kill the process; idempotent."""
        self._disconnect()
        if self._manager.has_kernel:
            with _mapped("shut down", self.id):
                await self._manager.shutdown_kernel(now=True)

    async def interrupt(self) -> None:
        """SIGINT to the kernel's process group (its subprocesses too)."""
        with _mapped("interrupt", self.id):
            await self._manager.interrupt_kernel()

    async def exit_code(self) -> int | None:
        """None while the process runs, else its exit status."""
        provisioner = self._manager.provisioner
        if provisioner is None or not provisioner.has_process:
            return -1
        code = await provisioner.poll()
        return None if code is None else int(code)

    def execute(self, code: str, *, silent: bool = False,
                user_expressions: Mapping[str, str] | None = None) -> str:
        """Send an execute_request; its msg_id."""
        with _mapped("send code to", self.id):
            return str(self._channels().execute(
                code, silent=silent, store_history=not silent,
                user_expressions=dict(user_expressions or {}), allow_stdin=False,
                stop_on_error=not silent))

    async def next_iopub(self, timeout_s: float) -> Message | None:
        """The next iopub message, or None if none came within `timeout_s`."""
        with _mapped("read from", self.id):
            try:
                msg: Message = await self._channels().get_iopub_msg(timeout=timeout_s)
            except queue.Empty:
                return None
        return msg

    async def reply(self, msg_id: str, timeout_s: float) -> Message | None:
        """The shell reply to `msg_id` (replies to older requests are dropped), or None."""
        deadline = time.monotonic() + timeout_s
        with _mapped("read from", self.id):
            while (left := deadline - time.monotonic()) > 0:
                try:
                    msg: Message = await self._channels().get_shell_msg(timeout=left)
                except queue.Empty:
                    return None
                if msg.get("parent_header", {}).get("msg_id") == msg_id:
                    return msg
        return None

    def _channels(self) -> AsyncKernelClient:
        if self._client is None:
            raise KernelError(f"kernel {self.id} is not connected")
        return self._client

    async def _connect(self) -> None:
        client = self._manager.client()
        client.start_channels()
        try:
            with _mapped("wait for", self.id):
                await client.wait_for_ready(timeout=self._ready_timeout_s)
        except BaseException:
            client.stop_channels()
            raise
        self._client = client

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.stop_channels()
