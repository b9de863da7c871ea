"""The Linux calls a jail makes in the VMM's child process before exec (ctypes).

Python 3.11 has no `os.unshare`/`os.setns`/mount/pivot_root, and the jail must set itself
up in the forked child (its mount namespace, its root, its network namespace, its TAP
file descriptor and its credentials belong to that process alone), so these are thin
libc wrappers. They raise `OSError` with the errno and the path, like `os` functions.
The libc handle is loaded once in the parent: the child only calls into it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import struct

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]
_SYS_PIVOT_ROOT = 155  # x86_64; glibc has no wrapper


def _check(rc: int, what: str, path: str | None = None) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags,
                       None if data is None else ctypes.c_char_p(data.encode())),
           "mount", target)


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(_b(target), flags), "umount2", target)


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root", new_root)


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl")


def open_tap(name: str) -> int:
    """Attach to the TAP device `name` of the current network namespace; the flags are
    the ones QEMU uses when it opens a TAP itself (`-netdev tap,ifname=`), so a guest sees
    the same device either way (virtio-net with the vnet header)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
    except BaseException:
        os.close(fd)
        raise
    return fd
