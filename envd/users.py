"""Resolve the Unix user a request runs as, and its home/ids."""

from __future__ import annotations

import pwd
from dataclasses import dataclass


class UnknownUserError(LookupError):
    """The requested user does not exist in the guest."""

    def __init__(self, name: str) -> None:
        super().__init__(f"invalid username: '{name}'")
        self.name = name


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str

    @classmethod
    def lookup(cls, name: str) -> User:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise UnknownUserError(name) from None
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir, pw.pw_shell)
