"""The volume file protocol between a guest's mounts and the host (both sides use this).

One TCP connection carries one request at a time; each message is

    >II  header length, payload length
    header   JSON object (UTF-8)
    payload  raw bytes (a write's data, a read's answer; else empty)

A request's header has `id` (a random 63-bit number, unique per request: the host answers
a retried mutation from its duplicate-request cache instead of doing it twice, as NFS
servers do), `op`, `vol` (the volume's name) and `path` (absolute inside the volume), plus
the operation's arguments. The answer's header has `errno` (0: done) and the results.
A raw framing rather than HTTP: one round trip and no parsing per FUSE operation, and
nothing a guest sends is read past the bounds below.
"""

from __future__ import annotations

import json
import struct
from typing import Any

PORT = 49982                 # on the guest's gateway address (the host, in its namespace)
MAX_HEADER = 64 << 10
MAX_PAYLOAD = 4 << 20        # > the largest FUSE read/write (1 MiB)
MAX_PATH = 4096
_PREFIX = struct.Struct(">II")
PREFIX_SIZE = _PREFIX.size

# operations that change the volume: answered from the duplicate-request cache when retried
MUTATIONS = frozenset({"mkdir", "unlink", "rmdir", "symlink", "rename", "link", "create",
                       "chmod", "chown", "truncate", "utimens", "write"})


class ProtocolError(Exception):
    pass


def encode(header: dict[str, Any], payload: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(len(head), len(payload)) + head + payload


def sizes(prefix: bytes) -> tuple[int, int]:
    """(header length, payload length) of a message, refused past the bounds."""
    head, payload = _PREFIX.unpack(prefix)
    if head > MAX_HEADER or payload > MAX_PAYLOAD:
        raise ProtocolError(f"message too large ({head} + {payload} bytes)")
    return head, payload


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"bad header: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    return header
