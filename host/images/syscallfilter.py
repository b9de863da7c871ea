"""Seccomp filters for the confined helper (confined.py and what it runs), through
libseccomp's C API.

Standalone (Python 3.11 stdlib): copied beside confined.py. The stdlib has no seccomp
binding and the helper runs with the system python3 alone; libseccomp2 is on every Debian
host (systemd links it), and it writes the BPF (the arch check, x32 refused) that a
hand-made filter would get wrong.
"""

from __future__ import annotations

import ctypes
import errno
import os


class SeccompError(Exception):
    pass


_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7
_CLONE_THREAD = 0x00010000
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
              0x40000000)  # NS, CGROUP, UTS, IPC, USER, PID, NET: no namespace of its own
# Kernel surface nothing here needs, refused from the start (fuse2fs included): debugging
# other processes, BPF, io_uring, keys, modules, namespaces, handles, host clocks, ...
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "bpf",
          "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "keyctl", "add_key", "request_key", "kexec_load",
          "kexec_file_load", "init_module", "finit_module", "delete_module", "unshare",
          "setns", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "swapon",
          "swapoff", "reboot", "acct", "quotactl", "syslog", "settimeofday", "clock_settime",
          "clock_adjtime", "adjtimex", "fanotify_init", "lookup_dcookie", "vhangup", "uselib",
          "pivot_root", "chroot")
# ...and once the image is mounted, while the layer is read: no more mounts, no new
# program (nothing past this point runs one), no new process (`processes=False`)
DENIED_APPLYING = ("mount", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
                   "fspick", "mount_setattr", "execve", "execveat", "fork", "vfork")


class _ScmpArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def deny_syscalls(names: tuple[str, ...], *, namespaces: bool = False,
                  processes: bool = True) -> None:
    """Load a seccomp filter refusing `names` with EPERM on this process and every child it
    starts from now on; with `namespaces`, clone3 too (ENOSYS: the C library falls back to
    clone, whose flags a filter can read) and clone asking for a namespace; without
    `processes`, clone of anything but a thread (the C library's fork is a clone). Filters
    stack: a later one only refuses more."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise SeccompError(f"libseccomp missing ({exc}): apt-get install libseccomp2") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ScmpArg)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]

    def errno_action(err: int) -> int:
        return 0x00050000 | (err & 0xFFFF)

    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompError("seccomp_init failed")
    try:
        rules: list[tuple[str, int, list[_ScmpArg]]] = [
            (name, errno_action(errno.EPERM), []) for name in names]
        if namespaces:
            rules.append(("clone3", errno_action(errno.ENOSYS), []))
            rules += [("clone", errno_action(errno.EPERM),
                       [_ScmpArg(0, _SCMP_CMP_MASKED_EQ, flag, flag)]) for flag in _CLONE_NEW]
        if not processes:
            rules.append(("clone", errno_action(errno.EPERM),
                          [_ScmpArg(0, _SCMP_CMP_MASKED_EQ, _CLONE_THREAD, 0)]))
        for name, action, args in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall of this kernel's arch
            arr = (_ScmpArg * max(1, len(args)))(*args)
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(args), arr)
            if rc != 0:
                raise SeccompError(f"seccomp rule for {name}: {os.strerror(-rc)}")
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            raise SeccompError(f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def filters() -> int:
    """How many seccomp filters this process runs under (the layer was read under)."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next((int(line.split()[1]) for line in status
                     if line.startswith("Seccomp_filters:")), 0)
