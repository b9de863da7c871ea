"""Issue 14 parity checks (items 3, 5, 6, 8) through the unmodified Python SDK.

Each check sets up what it needs through the SDK itself (`commands.run` as the default
user `user`), so the same check runs against envd on this host (tests/envd/
test_parity_envd.py) and against a sandbox VM (tests/e2e/test_parity_envd.py). What E2B's
envd does, with the Go file each expectation comes from:

- item 3, symlinks (infra shared/pkg/filesystem/entry.go `GetEntryInfo`, envd
  services/filesystem/dir.go `walkDir`): a link reports its target's type and permission
  bits, `symlink_target` is the absolute, fully resolved target, `permissions` is Go's
  `Lrwxrwxrwx`, size is the link's own; an unresolvable link has type UNSPECIFIED (the
  SDKs: `None`, dropped from `list`), its own path as target and mode 0. `list` reports
  links the same way and does not descend into linked directories.
- item 5, watches (envd services/filesystem/watch.go over e2b-dev/fsnotify v0.0.1
  backend_inotify.go): one event per inotify op, no dedup; a new file written by
  POST /files is CREATE, CHMOD (chown), WRITE; an existing one CHMOD, WRITE; rename is
  RENAME old + CREATE new; a recursive watch reports what appears inside new directories.
- item 6, PTY re-attach: output after a reconnect reaches the new stream.
- item 8, uploads (envd api/upload.go `processFile`, permissions/path.go `EnsureDirs`):
  envd writes as root and gives the file and the parent directories it made to the user,
  so `/0/x.txt` as `user` succeeds; ours publishes the files of one request together.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Callable

from e2b import AsyncSandbox, FileType, PtySize, Sandbox


def _sh(sbx: Sandbox, script: str, *, user: str | None = None) -> str:
    return sbx.commands.run(script, user=user).stdout


# ---------------------------------------------------------------- item 3: symlinks

def check_symlink_entries(sbx: Sandbox, base: str) -> None:
    """get_info and list of links to a file, to a dir, relative, dangling, chained, looping."""
    f = f"{base}/f.txt"
    _sh(sbx, f"mkdir -p {base}/sub && cd {base} && printf hello > f.txt && chmod 640 f.txt "
             f"&& chmod 751 sub && printf in > sub/inner.txt && ln -s {f} abs && "
             "ln -s f.txt rel && ln -s sub dirlink && ln -s missing dangling && "
             "ln -s rel chain && ln -s loop2 loop1 && ln -s loop1 loop2")
    links = {"abs": (FileType.FILE, f, 0o640, len(f)),
             "rel": (FileType.FILE, f, 0o640, len("f.txt")),
             "chain": (FileType.FILE, f, 0o640, len("rel")),
             "dirlink": (FileType.DIR, f"{base}/sub", 0o751, len("sub"))}
    for name, (type_, target, mode, size) in links.items():
        info = sbx.files.get_info(f"{base}/{name}")
        got = (info.name, info.path, info.type, info.symlink_target, info.mode,
               info.permissions, info.size)
        assert got == (name, f"{base}/{name}", type_, target, mode, "Lrwxrwxrwx", size), got
    for name in ("dangling", "loop1"):
        info = sbx.files.get_info(f"{base}/{name}")
        got = (info.type, info.symlink_target, info.mode, info.permissions)
        assert got == (None, f"{base}/{name}", 0, "Lrwxrwxrwx"), (name, got)
    plain = sbx.files.get_info(f)
    assert (plain.type, plain.symlink_target, plain.mode) == (FileType.FILE, None, 0o640)

    entries = {e.name: e for e in sbx.files.list(base)}
    # unresolvable links are UNSPECIFIED on the wire, which the SDK's list drops
    assert set(entries) == {"f.txt", "sub", *links}, sorted(entries)
    for name, (type_, target, mode, _) in links.items():
        e = entries[name]
        assert (e.type, e.symlink_target, e.mode, e.path) == (type_, target, mode,
                                                              f"{base}/{name}"), name
    deep = {e.path for e in sbx.files.list(base, depth=2)}
    assert f"{base}/sub/inner.txt" in deep and f"{base}/dirlink/inner.txt" not in deep

    # metadata is the target's (E2B reads the xattrs through the link)
    sbx.files.write(f"{base}/meta.txt", "m", metadata={"k": "v"})
    _sh(sbx, f"ln -s meta.txt {base}/metalink")
    assert sbx.files.get_info(f"{base}/metalink").metadata == {"k": "v"}


# ---------------------------------------------------------------- item 5: watch events

Recorder = list[tuple[str, str]]


def by_name(events: Recorder, name: str) -> list[str]:
    return [t for n, t in events if n == name]


async def _until(pred: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def check_watch_events(sbx: AsyncSandbox, base: str, *, recursive: bool,
                             timeout_s: float = 10, settle_s: float = 0.5) -> Recorder:
    """SDK writes, rename, remove, chmod and (recursive) nested directories under a
    streaming watch; returns the events for the caller's own checks."""
    w = f"{base}/{'rec' if recursive else 'flat'}"
    await sbx.commands.run(f"mkdir -p {w} && cd {w} && printf 1 > old.txt && "
                           "printf 1 > r1.txt && printf 1 > c.txt && printf 1 > x.txt")
    events: Recorder = []
    handle = await sbx.files.watch_dir(w, lambda e: events.append((e.name, e.type.name)),
                                       recursive=recursive, timeout=0)
    try:
        await sbx.files.write(f"{w}/new.txt", "hello")
        await sbx.files.write(f"{w}/old.txt", "hello again")
        await sbx.files.rename(f"{w}/r1.txt", f"{w}/r2.txt")
        await sbx.commands.run(f"chmod 600 {w}/c.txt")
        await sbx.files.remove(f"{w}/x.txt")
        await sbx.commands.run(f"mkdir -p {w}/n1/n2/n3 && printf x > {w}/n1/n2/n3/f.txt")
        nested = ["n1", "n1/n2", "n1/n2/n3", "n1/n2/n3/f.txt"] if recursive else ["n1"]
        assert await _until(lambda: all("CREATE" in by_name(events, n) for n in nested),
                            timeout_s), events
        await sbx.files.write(f"{w}/n1/n2/n3/g.txt", "g")
        await sbx.commands.run(f"chmod 700 {w}/n1")
        expect = {
            "new.txt": ["CREATE", "CHMOD", "WRITE"],
            "old.txt": ["CHMOD", "WRITE"],
            "r1.txt": ["RENAME"], "r2.txt": ["CREATE"],
            "c.txt": ["CHMOD"], "x.txt": ["REMOVE"],
            # a recursive watch sees a directory's chmod twice: from it and from its parent
            "n1": ["CREATE", "CHMOD", "CHMOD"] if recursive else ["CREATE", "CHMOD"],
        }
        if recursive:
            expect["n1/n2/n3/g.txt"] = ["CREATE", "CHMOD", "WRITE"]
        assert await _until(lambda: all(len(by_name(events, n)) >= len(v)
                                        for n, v in expect.items()), timeout_s), events
        await asyncio.sleep(settle_s)  # nothing more may come
        for name, types in expect.items():
            assert by_name(events, name) == types, (name, events)
        if recursive:
            for name in nested[1:]:
                assert by_name(events, name)[0] == "CREATE", (name, events)
        else:
            assert not [n for n, _ in events if n.startswith("n1/")], events
        assert not [n for n, _ in events if ".envd-upload-" in n], events
    finally:
        await handle.stop()
    return events


def check_polling_watch(sbx: Sandbox, base: str, *, timeout_s: float = 10) -> None:
    """The sync SDK's CreateWatcher/GetWatcherEvents path reports the same sequence."""
    w = f"{base}/poll"
    _sh(sbx, f"mkdir -p {w} && printf 1 > {w}/old.txt")
    handle = sbx.files.watch_dir(w)
    try:
        sbx.files.write(f"{w}/new.txt", "hello")
        sbx.files.write(f"{w}/old.txt", "2")
        events: Recorder = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(events) < 5:
            events += [(e.name, e.type.name) for e in handle.get_new_events()]
            time.sleep(0.1)
        time.sleep(0.3)
        events += [(e.name, e.type.name) for e in handle.get_new_events()]
        assert by_name(events, "new.txt") == ["CREATE", "CHMOD", "WRITE"], events
        assert by_name(events, "old.txt") == ["CHMOD", "WRITE"], events
    finally:
        handle.stop()


# ---------------------------------------------------------------- item 6: PTY re-attach

async def check_pty_reattach(sbx: AsyncSandbox, *, timeout_s: float = 15) -> None:
    """create → disconnect → connect: input sent afterwards shows its command's output on
    the new handle; twice, the second time with the shell surely at its prompt."""
    first = bytearray()
    handle = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=first.extend, timeout=0)
    pid = handle.pid
    try:
        await handle.disconnect()
        for n, (command, wanted) in enumerate([(b"echo hi-$((1+1))\n", b"hi-2"),
                                               (b"echo again-$((2+2))\n", b"again-4")]):
            seen = bytearray()
            again = await sbx.pty.connect(pid, on_data=seen.extend, timeout=0)
            await sbx.pty.send_stdin(pid, command)
            got = await _until(lambda w=wanted, s=seen: w in s, timeout_s)
            assert got, (n, bytes(seen))
            await again.disconnect()
    finally:
        await sbx.pty.kill(pid)


def check_pty_reattach_sync(sbx: Sandbox, *, timeout_s: float = 15) -> None:
    """The same with the sync SDK, whose first handle is never read before it disconnects."""
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    pid = handle.pid
    handle.disconnect()
    again = sbx.pty.connect(pid, timeout=0)
    seen = bytearray()
    found = threading.Event()

    def read() -> None:
        try:
            for _, _, pty in again:
                if pty:
                    seen.extend(pty)
                    if b"hi-2" in seen:
                        found.set()
        except Exception:  # noqa: BLE001, S110 - the kill below ends the stream with an error
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sbx.pty.send_stdin(pid, b"echo hi-$((1+1))\n")
        assert found.wait(timeout_s), bytes(seen)
    finally:
        sbx.pty.kill(pid)
        reader.join(timeout=10)


# ---------------------------------------------------------------- item 8: write_files

def _owner(sbx: Sandbox, *paths: str) -> list[str]:
    return _sh(sbx, "stat -c %U:%G " + " ".join(paths)).split()


def check_write_files_parents(sbx: Sandbox, base: str, top: str) -> None:
    """`top` (a directory under / that does not exist, e.g. /0) cannot be made by `user`;
    E2B's envd makes it as root and gives it to the user, so every file is written."""
    try:
        infos = sbx.files.write_files([{"path": f"{base}/wf/a.txt", "data": "a"},
                                       {"path": f"{top}/x.txt", "data": "x"}])
        assert [i.path for i in infos] == [f"{base}/wf/a.txt", f"{top}/x.txt"]
        assert sbx.files.read(f"{top}/x.txt") == "x" and sbx.files.read(f"{base}/wf/a.txt") == "a"
        assert _owner(sbx, top, f"{top}/x.txt", f"{base}/wf") == ["user:user"] * 3
        # octet-stream (file-like data): one request per file, same result
        infos = sbx.files.write_files([{"path": f"{top}/deeper/y.txt", "data": io.BytesIO(b"y")},
                                       {"path": f"{base}/wf/b.txt", "data": io.BytesIO(b"b")}])
        assert len(infos) == 2 and sbx.files.read(f"{top}/deeper/y.txt") == "y"
        assert _owner(sbx, f"{top}/deeper", f"{top}/deeper/y.txt") == ["user:user"] * 2
    finally:
        _sh(sbx, f"rm -rf {top}", user="root")


def check_write_files_all_or_nothing(sbx: Sandbox, base: str) -> None:
    """A request that cannot write one of its files writes none, makes no directory and
    names the failing path."""
    from e2b.exceptions import SandboxException

    _sh(sbx, f"mkdir -p {base}/aon && printf old > {base}/aon/keep.txt && "
             f"printf plain > {base}/aon/plain")
    bad = f"{base}/aon/plain/x.txt"  # a regular file in the way of a parent directory
    try:
        sbx.files.write_files([{"path": f"{base}/aon/new1/a.txt", "data": "a"},
                               {"path": f"{base}/aon/keep.txt", "data": "new"},
                               {"path": bad, "data": "x"}])
        raise AssertionError("the write must fail")
    except SandboxException as exc:
        assert bad in str(exc), exc
    assert sorted(e.name for e in sbx.files.list(f"{base}/aon")) == ["keep.txt", "plain"]
    assert sbx.files.read(f"{base}/aon/keep.txt") == "old"
