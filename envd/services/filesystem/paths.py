"""Turn request paths into absolute guest paths (upstream envd's ExpandAndResolve).

Accepted forms: absolute (`/tmp/a`), home-relative (`~`, `~/a`) and relative
(`a/b`, resolved against the user's home). `.`/`..` components are folded
lexically; symlinks are *not* followed, so Stat of a link reports the link.
"""

from __future__ import annotations

import os.path

from ...users import User


class InvalidPathError(ValueError):
    """The request path cannot be resolved (maps to invalid_argument / 400)."""


def resolve(path: str, user: User) -> str:
    """Absolute, normalized form of `path` as seen by `user`."""
    if "\x00" in path:
        raise InvalidPathError(f"path '{path}' contains a NUL byte")
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    elif path.startswith("~"):
        # `~other/x` would need another user's home; upstream does not expand it either.
        raise InvalidPathError(f"path '{path}' uses an unsupported home expansion")
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    resolved = os.path.normpath(path)
    # normpath keeps a leading '//' (POSIX allows it to be special); Linux does not care.
    if resolved.startswith("//"):
        resolved = "/" + resolved.lstrip("/")
    return resolved
