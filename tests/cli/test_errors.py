"""Host-only checks of the CLI's error table and Connect envelope decoding."""

from __future__ import annotations

import json
import struct

import pytest

from host.cli.envd import _envelopes
from host.cli.errors import ApiError, CliError, exit_code_for_status


@pytest.mark.parametrize(("status", "code"), [(400, 1), (401, 3), (403, 3), (404, 4),
                                               (409, 5), (500, 1), (503, 1)])
def test_status_to_exit_code(status: int, code: int) -> None:
    assert exit_code_for_status(status) == code
    err = ApiError(status, "boom")
    assert err.exit_code == code and err.message == f"API error {status}: boom"


def _env(flags: int, msg: object) -> bytes:
    raw = json.dumps(msg).encode()
    return struct.pack(">BI", flags, len(raw)) + raw


def test_envelopes_split_anywhere() -> None:
    data = _env(0, {"a": 1}) + _env(0, {"b": 2}) + _env(2, {})
    # one byte per chunk: messages are reassembled across reads
    assert list(_envelopes(iter([data[i:i + 1] for i in range(len(data))]))) == [{"a": 1},
                                                                                 {"b": 2}]


def test_envelope_end_stream_error() -> None:
    data = _env(0, {"a": 1}) + _env(2, {"error": {"code": "not_found", "message": "no proc"}})
    it = _envelopes(iter([data]))
    assert next(it) == {"a": 1}
    with pytest.raises(ApiError) as info:
        next(it)
    assert info.value.exit_code == 4 and "not_found: no proc" in info.value.message


def test_truncated_stream() -> None:
    with pytest.raises(CliError, match="middle of a message"):
        list(_envelopes(iter([_env(0, {"a": 1})[:-1]])))
