"""The server's exceptions; app.py maps each to one HTTP status in one table.

    CodeInterpreterError
    ├── RequestError            400: malformed body, bad field, unsupported language, bad cwd
    ├── ContextNotFoundError    404: no context with that id (the SDKs raise NotFound)
    └── KernelError             500: a kernel could not be started, restarted or reached
        └── KernelDiedError     the kernel process exited while an execution waited on it
"""

from __future__ import annotations


class CodeInterpreterError(Exception):
    """Base class of every error this server raises on purpose."""


class RequestError(CodeInterpreterError, ValueError):
    """The request is malformed or asks for something this server does not do."""


class ContextNotFoundError(CodeInterpreterError, LookupError):
    """No context has the given id."""

    def __init__(self, context_id: str) -> None:
        super().__init__(f"Context {context_id} not found")
        self.context_id = context_id


class KernelError(CodeInterpreterError, RuntimeError):
    """A kernel could not be started, restarted or talked to."""


class KernelDiedError(KernelError):
    """The kernel process exited (crash, os._exit, OOM kill) during an execution."""

    def __init__(self, exit_code: int | None) -> None:
        super().__init__(f"the kernel died (exit code {exit_code})")
        self.exit_code = exit_code
