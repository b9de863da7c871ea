"""Codecs that reject undecodable request bodies as `invalid_argument` (not `unknown`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import Codec, proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError


class StrictCodec:
    """Wraps a connectrpc codec: a decode failure becomes ConnectError(INVALID_ARGUMENT)."""

    def __init__(self, inner: Codec[Any, Any]) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as exc:  # malformed JSON / wrong field types / bad proto
            name = getattr(message_class, "__name__", "message")
            raise ConnectError(
                Code.INVALID_ARGUMENT, f"cannot decode {name} ({self.name()}): {exc}"
            ) from exc


def codecs() -> Sequence[Any]:
    """Codecs for every Connect service: JSON (what the SDKs speak) and binary proto."""
    return (StrictCodec(proto_json_codec()), StrictCodec(proto_binary_codec()))


__all__ = ["StrictCodec", "codecs"]
