"""Connect protocol envelopes (connectrpc.com/docs/protocol, streaming): flags (1 byte),
big-endian length (4 bytes), message. The host frames the few streaming calls it makes or
ends itself by hand (the CLI's exec, the orchestrator's guest sync, the proxy's
end-of-stream on a sandbox that went away): small enough not to warrant a second RPC client
stack next to httpx."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import Any

COMPRESSED = 0x01
END_STREAM = 0x02
_HEAD = struct.Struct(">BI")


class EnvelopeError(ValueError):
    """A stream ended in the middle of an envelope, or a message is not JSON."""


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One JSON message as an envelope."""
    payload = json.dumps(message).encode()
    return _HEAD.pack(flags, len(payload)) + payload


def messages(chunks: Iterable[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(flags, JSON message) of each envelope in a byte stream cut anywhere."""
    buf = b""
    for chunk in chunks:
        buf += chunk
        while len(buf) >= _HEAD.size:
            flags, length = _HEAD.unpack_from(buf)
            if len(buf) < _HEAD.size + length:
                break
            payload, buf = buf[_HEAD.size:_HEAD.size + length], buf[_HEAD.size + length:]
            try:
                yield flags, json.loads(payload or b"{}")
            except ValueError as exc:
                raise EnvelopeError(f"a message is not JSON: {exc}") from exc
    if buf:
        raise EnvelopeError("the stream ended in the middle of a message")
