"""Connect protocol envelopes (connectrpc.com/docs/protocol, streaming): flags (1 byte),
big-endian length (4 bytes), message. The host frames the few streaming calls it makes or
ends itself by hand (the CLI's exec, the orchestrator's guest sync, the proxy's
end-of-stream on a sandbox that went away): small enough not to warrant a second RPC client
stack next to httpx.

`Decoder` takes a stream cut anywhere; with `max_bytes` it refuses an envelope from its
header alone, so a peer that claims a 4 GiB message costs 5 bytes, not 4 GiB
(host/guestio.py sets the limits for what guests send)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import Any

COMPRESSED = 0x01
END_STREAM = 0x02
_HEAD = struct.Struct(">BI")


class EnvelopeError(ValueError):
    """A stream ended in the middle of an envelope, or a message is not a JSON object."""


class EnvelopeTooLargeError(EnvelopeError):
    """An envelope's header claims more than the reader takes."""

    def __init__(self, length: int, max_bytes: int) -> None:
        super().__init__(f"a message of {length} bytes (the limit is {max_bytes})")
        self.length = length
        self.max_bytes = max_bytes


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One JSON message as an envelope."""
    payload = json.dumps(message).encode()
    return _HEAD.pack(flags, len(payload)) + payload


class Decoder:
    """(flags, JSON message) of each envelope in a byte stream fed in chunks cut anywhere.

    Holds at most one envelope plus the chunk that completed it. `max_bytes`: the largest
    message taken; a header claiming more raises EnvelopeTooLargeError before any more
    of its body is waited for."""

    def __init__(self, *, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
        buf = self._buf
        buf += chunk
        while len(buf) >= _HEAD.size:
            flags, length = _HEAD.unpack_from(buf)
            if self.max_bytes is not None and length > self.max_bytes:
                raise EnvelopeTooLargeError(length, self.max_bytes)
            end = _HEAD.size + length
            if len(buf) < end:
                break
            payload = bytes(buf[_HEAD.size:end])
            # consumed before yielding: a caller that stops early leaves a clean buffer
            del buf[:end]
            yield flags, _decode(payload)

    def close(self) -> None:
        """The stream ended: raises if it ended inside an envelope."""
        if self._buf:
            raise EnvelopeError("the stream ended in the middle of a message")


def _decode(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload or b"{}")
    except ValueError as exc:
        raise EnvelopeError(f"a message is not JSON: {exc}") from exc
    # every Connect JSON message is an object; callers index it as one
    if not isinstance(message, dict):
        raise EnvelopeError(f"a message is JSON but not an object: {type(message).__name__}")
    return message


def messages(chunks: Iterable[bytes], *, max_bytes: int | None = None
             ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(flags, JSON message) of each envelope in a byte stream cut anywhere."""
    decoder = Decoder(max_bytes=max_bytes)
    for chunk in chunks:
        yield from decoder.feed(chunk)
    decoder.close()
