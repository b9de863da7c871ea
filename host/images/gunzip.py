"""A gzip layer inflated by ISA-L's `igzip` in a process of its own, inside the helper.

Standalone (Python 3.11 stdlib): copied beside confined.py, which starts it before it reads
the layer (once the image is mounted its second filter allows no new program). Why: the
bench's Debian layer (107 MiB of gzip, 283 MiB of tar) takes Python's zlib 1.03 s in the
helper's one thread, in front of everything else the helper does with the tar (the diff
id, each entry's checks, mke2fs's feed); `igzip -dc` (Debian's `isal`) inflates it in
0.39 s, on the other core. The untrusted stream is still inflated confined: igzip runs as
the helper's uid, in its namespaces, under its first seccomp filter and no_new_privs.
Without igzip on the host the helper reads the gzip itself, as before (layertar's
`open_layer`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from typing import IO

try:  # run as a script beside layertar.py (the helper); imported as host.images.gunzip
    from layertar import ApplyError, widen_pipe  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from host.images.layertar import ApplyError, widen_pipe

_SAID_LIMIT = 4096  # the end of what igzip says when it fails


class GzipFailed(ApplyError):
    """The layer's gzip stream could not be inflated (corrupt, truncated, not gzip)."""


def inflater() -> str | None:
    """igzip's path on this host, or None."""
    return shutil.which("igzip")


@contextlib.contextmanager
def layer_input(stdin: IO[bytes], gzipped: bool) -> Iterator[IO[bytes]]:
    """The layer's tar: `stdin` itself, or (`gzipped` and igzip here) what igzip makes of
    it. On the way out igzip is stopped and waited for; if it failed (other than by the
    reader stopping early), GzipFailed says why, in place of the reader's own error (a
    tar cut short is what a corrupt gzip looks like to it)."""
    tool = inflater() if gzipped else None
    if tool is None:
        yield stdin
        return
    with tempfile.TemporaryFile() as said:  # the namespace's /tmp (a tmpfs)
        proc = subprocess.Popen([tool, "-d", "-c"], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=said)
        assert proc.stdout is not None
        widen_pipe(proc.stdout.fileno())
        try:
            yield proc.stdout
        finally:
            proc.stdout.close()  # a reader that stopped early: igzip's write fails, it exits
            code = proc.wait()
            if code not in (0, -signal.SIGPIPE):  # raised over the reader's error, if any
                said.seek(0)
                why = said.read().decode(errors="replace").strip()[-_SAID_LIMIT:]
                raise GzipFailed(f"the layer's gzip stream is corrupt: igzip exited {code}: "
                                 f"{why or 'no message'}")

