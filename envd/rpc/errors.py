"""Translate exceptions raised by handlers into Connect errors (one table, at the edge).

Nothing raised inside a handler may reach connectrpc as a bare exception: it would be
sent as code `unknown` with the raw exception text and re-raised to the ASGI server
(a 500 in the access log). `to_connect_error` is the single mapping table.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ..auth import AuthError
from ..users import UnknownUserError

log = logging.getLogger("envd.rpc")

# errno → Connect code; anything else from the OS is INTERNAL.
_ERRNO_CODES: dict[int, Code] = {
    errno.ENOENT: Code.NOT_FOUND,
    errno.ESRCH: Code.NOT_FOUND,
    errno.EACCES: Code.PERMISSION_DENIED,
    errno.EPERM: Code.PERMISSION_DENIED,
    errno.EROFS: Code.PERMISSION_DENIED,
    errno.EEXIST: Code.ALREADY_EXISTS,
    errno.ENOTEMPTY: Code.ALREADY_EXISTS,
    errno.EINVAL: Code.INVALID_ARGUMENT,
    errno.ENOTDIR: Code.INVALID_ARGUMENT,
    errno.EISDIR: Code.INVALID_ARGUMENT,
    errno.ENAMETOOLONG: Code.INVALID_ARGUMENT,
    errno.ELOOP: Code.INVALID_ARGUMENT,
    errno.EXDEV: Code.INVALID_ARGUMENT,
    errno.ENOEXEC: Code.INVALID_ARGUMENT,
    errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
    errno.EDQUOT: Code.RESOURCE_EXHAUSTED,
    errno.EMFILE: Code.RESOURCE_EXHAUSTED,
    errno.ENFILE: Code.RESOURCE_EXHAUSTED,
}


def _os_message(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    if exc.filename is not None:
        text = f"{text}: {exc.filename}"
    return text[:1].lower() + text[1:]


def to_connect_error(exc: BaseException) -> ConnectError:
    """The ConnectError a client should see for `exc` (ConnectErrors pass through)."""
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, UnknownUserError):
        return ConnectError(Code.UNAUTHENTICATED, str(exc))
    if isinstance(exc, AuthError):  # before OSError: AuthError is a PermissionError
        return ConnectError(Code.UNAUTHENTICATED, str(exc))
    if isinstance(exc, OSError) and exc.errno is not None:
        code = _ERRNO_CODES.get(exc.errno, Code.INTERNAL)
        if code is Code.INTERNAL:
            log.error("unmapped OS error in RPC handler", exc_info=exc)
        return ConnectError(code, _os_message(exc))
    if isinstance(exc, TimeoutError):
        return ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded")
    log.error("unexpected error in RPC handler", exc_info=exc)
    return ConnectError(Code.INTERNAL, f"internal error ({type(exc).__name__})")


@contextlib.contextmanager
def map_errors() -> Iterator[None]:
    """Re-raise any non-cancellation exception as the matching ConnectError."""
    try:
        yield
    except ConnectError:
        raise
    except Exception as exc:
        raise to_connect_error(exc) from exc


__all__ = ["map_errors", "to_connect_error"]
