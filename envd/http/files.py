"""GET and POST /files (spec §4.5): what download.py and upload.py share.

Both run file access as the user from the `username` query (default: the sandbox
default user), are authorized by X-Access-Token or a signed URL, stream the body
in bounded chunks (nothing is held in memory whole) and answer errors as JSON.
"""

from __future__ import annotations

from starlette.requests import Request

from ..auth import require_file_access
from ..state import Defaults
from ..users import User
from .errors import HTTPError, os_error_message, os_error_status


def user_and_path(defaults: Defaults, request: Request, operation: str) -> tuple[User, str, str]:
    """Authorize the request; return (user, raw path query, username query)."""
    q = request.query_params
    raw_path = q.get("path", "")
    username = q.get("username", "")
    require_file_access(
        defaults,
        presented_token=request.headers.get("x-access-token"),
        path=raw_path,
        operation=operation,
        user=username,
        signature=q.get("signature"),
        expiration=q.get("signature_expiration"),
    )
    return User.lookup(username or defaults.user), raw_path, username


def os_http_error(exc: OSError, path: str) -> HTTPError:
    return HTTPError(os_error_status(exc), os_error_message(exc, path))


__all__ = ["os_http_error", "user_and_path"]
