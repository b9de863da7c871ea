"""The preload that lets QEMU discard copy-on-write RAM over a shared base file.

A balloon (free-page reporting or inflation) returns guest pages to the host through
QEMU's RAM discard. For a VM whose RAM is a private mapping of a frozen base memory file,
QEMU 10 either refuses the discard (file opened read-only) or punches a hole in the base
(file opened for writing), which would corrupt every sibling. `private_ram.c` (read its
header) makes the discard the MADV_DONTNEED of the private mapping alone, with the base
opened read-only. It is compiled once per source version with the host's C compiler;
without one, such VMs keep their RAM read-only and their freed pages stay with them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("private_ram.c")
# names the base file for the preload: set only in the environment of the QEMU it loads in
ENV_PATH = "AENV_PRIVATE_RAM"

_lock = threading.Lock()
_built: dict[Path, Path | None] = {}


def private_ram_preload(cache_dir: Path) -> Path | None:
    """The shared object: prebuilt beside its source (`python -m host.vmm.qemu.preload`,
    as the node's container image does), else under `cache_dir`, built on first use; None
    (logged once) when no C compiler could build it."""
    with _lock:
        if cache_dir not in _built:
            _built[cache_dir] = _build(cache_dir)
        return _built[cache_dir]


def preload_env(lib: Path, base: Path) -> dict[str, str]:
    """The environment of a QEMU that maps `base` privately and may discard its RAM."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{lib} {env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(lib)
    env[ENV_PATH] = str(base)
    return env


def _name() -> str:
    return f"private_ram-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"


def _build(cache_dir: Path) -> Path | None:
    name = _name()
    prebuilt = SOURCE.with_name(name)
    if prebuilt.exists():
        return prebuilt
    out = cache_dir / name
    if out.exists():
        return out
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("no C compiler (cc) on this host: VMs restored from a memory snapshot "
                    "cannot return the memory their guests free (install gcc)")
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: a concurrent driver never loads half a file
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", tmp, str(SOURCE), "-ldl"],
                       check=True, capture_output=True, timeout=120)
        os.chmod(tmp, 0o755)  # loaded by jailed QEMUs, each as its own uid
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("cannot build the QEMU private-RAM preload (%s %s): VMs restored from "
                    "a memory snapshot keep the memory their guests free", exc,
                    detail.decode(errors="replace").strip())
        return None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


if __name__ == "__main__":  # prebuild beside the source (an image without a compiler)
    logging.basicConfig()
    built = _build(SOURCE.parent)
    if built is None:
        raise SystemExit("the preload did not build: see the warning above")
    print(built)
