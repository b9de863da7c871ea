"""Starting a child as another user without a full fork of envd.

Popen can switch credentials itself (`user=`, `group=`, `extra_groups=`), but then it
must fork: a vfork child may not call setuid in a multithreaded Python. A fork copies
envd's page tables and makes the parent take copy-on-write faults afterwards: ~20 ms of a
`commands.run("true")` in a TCG guest, where the SDKs run every command as `user`.

So envd vforks the guest init's small static helper `aenv-exec` (rootfs/init/init.c)
instead, which switches credentials and execs the program. Exec failures come back as
they do from Popen: the helper writes the errno to a close-on-exec pipe, read here, and
raised as the same OSError. Without the helper (or for a PTY, which needs a preexec_fn
and so a fork anyway) Popen switches itself, as before.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from typing import Any

from ...users import User

EXEC_HELPER = "/usr/sbin/aenv-exec"


def credentials(user: User) -> dict[str, Any]:
    """Popen arguments that switch to `user` (setgid, initgroups, setuid).

    Empty when we already run with exactly those credentials: asking Popen for a switch
    rules out its vfork fast path.
    """
    groups = os.getgrouplist(user.name, user.gid)
    if (user.uid, user.gid) == (os.geteuid(), os.getegid()) and \
            sorted(set(groups)) == sorted(set(os.getgroups()) | {os.getegid()}):
        return {}
    if os.geteuid() == 0:
        return {"user": user.uid, "group": user.gid, "extra_groups": groups}
    if user.uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"envd is not root, cannot run as {user.name!r}")
    return {}


def popen(argv: list[str], creds: dict[str, Any], **kw: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(argv, **kw)` as the user `creds` (from `credentials`) names."""
    helper = EXEC_HELPER
    if not creds or kw.get("preexec_fn") is not None or not os.access(helper, os.X_OK):
        return subprocess.Popen(argv, **kw, **creds)
    env = kw.get("env") or os.environ
    exe = argv[0]
    if "/" not in exe:  # Popen's lookup: the child's PATH (never a relative exec)
        found = shutil.which(exe, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), exe)
        exe = found
    groups = ",".join(str(g) for g in creds.get("extra_groups", ()))
    r, w = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                [helper, str(w), str(creds["user"]), str(creds["group"]), groups, exe, *argv],
                pass_fds=(w,), **kw)
        finally:
            os.close(w)
        report = os.read(r, 64)  # b"" once the helper exec'd the program (close-on-exec)
    finally:
        os.close(r)
    if report:
        proc.wait()
        code = int.from_bytes(report[:4], sys.byteorder)
        raise OSError(code, os.strerror(code), argv[0])  # FileNotFoundError for ENOENT
    return proc


__all__ = ["EXEC_HELPER", "credentials", "popen"]
