"""`envd volume-mount NAME PATH HOST:PORT`: one volume mounted at PATH, in the foreground.

One process per mount (started by mounts.py): libfuse owns its signals and threads, and
a crash takes one mount down, not envd. Mounted with `allow_other` (every guest user
sees it) and `default_permissions` (the guest kernel checks the owners and modes the
host reports), and no attribute or name caching (fs.py).
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import sys


def _library() -> None:
    """libfuse 3 (large writes, 1 MiB, by default): mfusepy would take libfuse 2 first.
    Frozen envd carries it beside its modules."""
    if "FUSE_LIBRARY_PATH" in os.environ:
        return
    bundle = getattr(sys, "_MEIPASS", None)
    found = (os.path.join(bundle, "libfuse3.so.3") if bundle
             else ctypes.util.find_library("fuse3"))
    if found:
        os.environ["FUSE_LIBRARY_PATH"] = found


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="envd volume-mount")
    p.add_argument("name")
    p.add_argument("path")
    p.add_argument("address", help="HOST:PORT of the host's volume server")
    args = p.parse_args(argv)
    host, _, port = args.address.rpartition(":")
    _library()
    import mfusepy as fuse  # type: ignore[import-untyped]  # after _library: loads libfuse

    from .client import HostClient
    from .fs import MAX_IO, VolumeFS

    try:
        fuse.FUSE(VolumeFS(HostClient(host, int(port), args.name)), args.path,
                  foreground=True, allow_other=True, default_permissions=True,
                  attr_timeout=0, entry_timeout=0, negative_timeout=0, max_threads=16,
                  max_read=MAX_IO,   # and max_write, max_readahead: fs.py's init
                  fsname=f"aenv-volume:{args.name}", subtype="aenv")
    except RuntimeError:
        if os.path.ismount(args.path):
            raise
        return 0        # unmounted from outside (umount): libfuse's loop ends with an error
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
