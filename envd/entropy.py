"""Reseeding the guest kernel's RNG with entropy the host sends in `/init` (`aenvEntropy`).

A sandbox restored from a memory snapshot (template, pause, fork) resumes the snapshot's
kernel RNG state: every child of one snapshot draws the same bytes from getrandom() and
/dev/urandom until the kernel reseeds on its own timer (up to a minute later), and our
guest kernel has no VM generation ID driver to do it at restore. So the host sends 64
fresh bytes with every /init; envd credits them to the input pool (`RNDADDENTROPY`) and
makes the CRNG reseed from it at once (`RNDRESEEDCRNG`). Both ioctls need CAP_SYS_ADMIN;
without it the bytes are written to /dev/urandom, which mixes them in without crediting
them or forcing a reseed. Nothing here raises: /init must not fail over its RNG.

envd itself keeps no userspace RNG state to reseed: its ids and temp names come from
`secrets` (getrandom() per call), never from the `random` module.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
import struct
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)
# envd's root logger shows warnings only (__main__); this module's one INFO line per
# /init is the console's proof that a restored guest was reseeded (tests/e2e read it).
log.setLevel(logging.INFO)

ENTROPY_FIELD = "aenvEntropy"  # hex; ours alone: E2B's envd ignores unknown fields
MAX_ENTROPY_BYTES = 512
RANDOM_DEVICE = "/dev/urandom"
# <linux/random.h>, generic ioctl numbering (x86_64, arm64):
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]): struct rand_pool_info
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07), Linux >= 4.17


class Reseed(enum.Enum):
    """What `reseed_kernel_rng` did (the value is how the log line says it)."""

    RESEEDED = "credited and the CRNG reseeded"  # RNDADDENTROPY + RNDRESEEDCRNG
    CREDITED = "credited, CRNG reseed refused"  # RNDADDENTROPY only
    MIXED = "mixed in without credit"  # write(2) fallback
    FAILED = "not mixed in"


def entropy_from(data: Mapping[str, Any]) -> bytes | None:
    """The decoded `aenvEntropy` of an /init body; None when absent or unusable (logged:
    a bad value must not fail /init)."""
    value = data.get(ENTROPY_FIELD)
    if value is None:
        return None
    try:
        raw = bytes.fromhex(value)  # TypeError for a non-string
    except (TypeError, ValueError) as exc:
        problem = str(exc)
    else:
        if 0 < len(raw) <= MAX_ENTROPY_BYTES:
            return raw
        problem = f"{len(raw)} bytes, want 1..{MAX_ENTROPY_BYTES}"
    log.warning("kernel RNG not reseeded: '%s' ignored: %s", ENTROPY_FIELD, problem)
    return None


def reseed_kernel_rng(entropy: bytes, *, device: str | None = None) -> Reseed:
    """Mix `entropy` into the kernel RNG, crediting it and forcing a CRNG reseed when
    allowed; else write it to the device (mixed, not credited). Blocking; never raises."""
    path = device or RANDOM_DEVICE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        return _report(Reseed.FAILED, entropy, f"open {path}: {exc}")
    try:
        try:
            pool_info = struct.pack("ii", 8 * len(entropy), len(entropy)) + entropy
            fcntl.ioctl(fd, RNDADDENTROPY, pool_info)
        except OSError as exc:
            # EPERM without CAP_SYS_ADMIN; ENOTTY when the path is no RNG device
            return _write_fallback(fd, entropy, f"RNDADDENTROPY: {_reason(exc)}")
        try:
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        except OSError as exc:  # EINVAL: CRNG not ready yet (the credit above seeds it)
            return _report(Reseed.CREDITED, entropy, f"RNDRESEEDCRNG: {_reason(exc)}")
        return _report(Reseed.RESEEDED, entropy)
    finally:
        os.close(fd)


def _write_fallback(fd: int, entropy: bytes, why: str) -> Reseed:
    try:
        written = os.write(fd, entropy)
    except OSError as exc:
        return _report(Reseed.FAILED, entropy, f"{why}; write: {_reason(exc)}")
    if written != len(entropy):
        return _report(Reseed.FAILED, entropy, f"{why}; short write {written}/{len(entropy)}")
    return _report(Reseed.MIXED, entropy, why)


def _reason(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _report(outcome: Reseed, entropy: bytes, why: str = "") -> Reseed:
    # never log the bytes themselves
    if outcome is Reseed.RESEEDED:
        log.info("kernel RNG reseeded: %d bytes from the host %s", len(entropy), outcome.value)
    else:
        log.warning("kernel RNG not reseeded: %d bytes from the host %s (%s)",
                    len(entropy), outcome.value, why)
    return outcome
