"""HTTP error bodies for envd's plain routes: `{"code": <status>, "message": "..."}`.

    HTTPError(status, message) ........ any route; rendered by `json_error`
    AuthError (envd.auth) ............. 401
    UnknownUserError (envd.users) ..... 401 (`invalid username: '<u>'`)
    InvalidPathError .................. 400
    OSError (file routes) ............. `os_error_status` table
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..auth import AuthError
from ..services.filesystem import InvalidPathError
from ..users import UnknownUserError

Endpoint = Callable[[Request], Awaitable[Response]]

log = logging.getLogger(__name__)

_ERRNO_STATUS = {
    errno.ENOENT: 404,
    errno.EACCES: 403,
    errno.EPERM: 403,
    errno.EROFS: 403,
    errno.ENOTDIR: 400,
    errno.EISDIR: 400,
    errno.ELOOP: 400,
    errno.ENAMETOOLONG: 400,
    errno.EINVAL: 400,
    errno.ENOSPC: 507,
    errno.EDQUOT: 507,
}


class HTTPError(Exception):
    """Answer the request with `status` and a JSON error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def os_error_status(exc: OSError) -> int:
    return _ERRNO_STATUS.get(exc.errno or 0, 500)


def os_error_message(exc: OSError, path: str) -> str:
    if exc.errno == errno.ENOENT:
        return f"path '{path}' does not exist"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"not enough disk space to write '{path}'"
    return f"{exc.strerror or exc}: '{path}'"


def json_errors(endpoint: Endpoint) -> Endpoint:
    """Render the exceptions above as JSON error responses."""

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except HTTPError as exc:
            return json_error(exc.status, exc.message)
        except (AuthError, UnknownUserError) as exc:
            return json_error(401, str(exc))
        except InvalidPathError as exc:
            return json_error(400, str(exc))
        except Exception as exc:
            # Anything unforeseen still answers in the JSON shape the SDKs parse.
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return json_error(500, f"internal error: {type(exc).__name__}: {exc}")

    return wrapper
