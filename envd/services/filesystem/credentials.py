"""Run blocking filesystem calls with a user's filesystem credentials.

envd runs as root, but file operations must succeed or fail exactly as they would
for the requesting user, and whatever they create must belong to that user. Linux
keeps the filesystem uid/gid (`setfsuid`/`setfsgid`) and the supplementary groups
per *thread* at the syscall level (glibc only broadcasts its own `setgroups`
wrapper to all threads, so we call the raw syscalls). A call therefore runs on a
dedicated worker thread that takes the user's credentials, does the work and
restores root's before the thread is reused. While fsuid != 0 the kernel also
drops CAP_DAC_OVERRIDE/CAP_CHOWN/CAP_FOWNER from the thread, so permission
checks are the user's and new inodes are owned by the user without a chown.

When envd does not run as root (unit tests), calls run with envd's own
credentials: the OS then enforces whatever envd itself may do.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ...users import User

T = TypeVar("T")

# Raw syscall numbers: per-thread credential changes (see module docstring).
_SYSCALLS = {
    "x86_64": {"setgroups": 116, "setfsuid": 122, "setfsgid": 123},
    "aarch64": {"setgroups": 159, "setfsuid": 151, "setfsgid": 152},
}

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_NR = _SYSCALLS.get(platform.machine())

# A dedicated pool: threads of the default executor are shared with other code,
# which must never run with borrowed credentials.
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


class CredentialsError(OSError):
    """The worker thread could not take (or give back) a user's credentials."""


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="envd-fs")
        return _executor


def _set_groups(groups: list[int]) -> None:
    assert _NR is not None
    arr = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _syscall(_NR["setgroups"], len(groups), arr) != 0:
        err = ctypes.get_errno()
        raise CredentialsError(err, f"setgroups: {os.strerror(err)}")


def _set_fs_ids(uid: int, gid: int) -> None:
    # setfsuid/setfsgid return the previous id and never fail loudly; read back to check.
    assert _NR is not None
    _syscall(_NR["setfsgid"], gid)
    _syscall(_NR["setfsuid"], uid)
    if _syscall(_NR["setfsuid"], -1) != uid or _syscall(_NR["setfsgid"], -1) != gid:
        raise CredentialsError(f"could not switch filesystem ids to {uid}:{gid}")


def needs_switch(user: User) -> bool:
    """True when calls for `user` must change the worker thread's credentials."""
    if os.geteuid() != 0 or user.uid == 0:
        return False
    if _NR is None:
        # Never fall back to running a user's request with root's rights.
        raise CredentialsError(f"cannot act as '{user.name}' on {platform.machine()}")
    return True


@functools.lru_cache(maxsize=64)
def _groups_of(name: str, gid: int) -> tuple[int, ...]:
    try:
        return tuple(os.getgrouplist(name, gid))
    except OSError:
        return (gid,)


def call_as(user: User, fn: Callable[..., T], /, *args: object) -> T:
    """Call `fn(*args)` on the current thread with `user`'s filesystem credentials."""
    if not needs_switch(user):
        return fn(*args)
    root_groups = os.getgroups()
    _set_groups(list(_groups_of(user.name, user.gid)))
    try:
        _set_fs_ids(user.uid, user.gid)
        return fn(*args)
    finally:
        # Order matters: fsuid 0 first gives back the capabilities needed to reset the rest.
        _set_fs_ids(0, 0)
        _set_groups(root_groups)


async def run_as(user: User, fn: Callable[..., T], /, *args: object) -> T:
    """Run blocking `fn(*args)` off the event loop as `user` (see module docstring)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), call_as, user, fn, *args)


def submit_blocking(fn: Callable[..., T], /, *args: object) -> Future[T]:
    """Start blocking `fn(*args)` on the filesystem pool (envd's credentials); a
    concurrent Future, so cleanup code can wait for it without an event loop."""
    return _pool().submit(fn, *args)


async def run_blocking(fn: Callable[..., T], /, *args: object) -> T:
    """Run blocking `fn(*args)` on the filesystem pool with envd's own credentials."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), fn, *args)
