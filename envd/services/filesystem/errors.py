"""Map filesystem failures to Connect errors, in one table (STYLE: errors at the edge).

    OSError
    ├── FileNotFoundError ........... not_found
    ├── FileExistsError ............. already_exists
    ├── PermissionError ............. permission_denied
    ├── NotADirectoryError, IsADirectoryError, ELOOP, ENAMETOOLONG, EINVAL ... invalid_argument
    ├── ENOSPC, EDQUOT .............. resource_exhausted
    └── anything else ............... internal
    InvalidPathError ................ invalid_argument
    UnknownUserError, AuthError ..... unauthenticated
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ...auth import AuthError
from ...users import UnknownUserError
from .paths import InvalidPathError

_ERRNO_CODES = {
    errno.ENOENT: Code.NOT_FOUND,
    errno.EEXIST: Code.ALREADY_EXISTS,
    errno.ENOTEMPTY: Code.ALREADY_EXISTS,
    errno.EACCES: Code.PERMISSION_DENIED,
    errno.EPERM: Code.PERMISSION_DENIED,
    errno.EROFS: Code.PERMISSION_DENIED,
    errno.ENOTDIR: Code.INVALID_ARGUMENT,
    errno.EISDIR: Code.INVALID_ARGUMENT,
    errno.ELOOP: Code.INVALID_ARGUMENT,
    errno.ENAMETOOLONG: Code.INVALID_ARGUMENT,
    errno.EINVAL: Code.INVALID_ARGUMENT,
    errno.EXDEV: Code.INVALID_ARGUMENT,
    errno.ENOSPC: Code.RESOURCE_EXHAUSTED,
    errno.EDQUOT: Code.RESOURCE_EXHAUSTED,
}


def os_error_code(exc: OSError) -> Code:
    return _ERRNO_CODES.get(exc.errno or 0, Code.INTERNAL)


def describe(exc: OSError, path: str | None = None) -> str:
    where = path or exc.filename
    reason = exc.strerror or str(exc)
    return f"{reason}: '{where}'" if where else reason


@contextlib.contextmanager
def connect_errors(path: str | None = None) -> Iterator[None]:
    """Translate OSError & friends raised inside the block into ConnectError."""
    try:
        yield
    except ConnectError:
        raise
    except (UnknownUserError, AuthError) as exc:
        raise ConnectError(Code.UNAUTHENTICATED, str(exc)) from exc
    except InvalidPathError as exc:
        raise ConnectError(Code.INVALID_ARGUMENT, str(exc)) from exc
    except OSError as exc:
        raise ConnectError(os_error_code(exc), describe(exc, path)) from exc
