"""Host-only checks of the CLI's error table, its hints (what to do), the mapping of
transport failures, and Connect envelope decoding."""

from __future__ import annotations

import json
import struct

import httpx
import pytest

from host.cli.envd import _envelopes
from host.cli.errors import ApiError, CliError, ConnectionFailed, exit_code_for_status
from host.cli.rest import raise_for_status, transport_errors


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


@pytest.mark.parametrize(("exc", "what", "line"), [
    (httpx.ConnectError("[Errno 111] Connection refused"), "API",
     ("cannot reach the API at http://h:1 (Connection refused): is the service running? "
      "(`make run`), or set --api-url / run `aenv auth login`")),
    (httpx.ConnectError("[Errno -2] Name or service not known"), "sandbox proxy",
     ("cannot reach the sandbox proxy at http://h:1 (Name or service not known): is the "
      "service running? (`make run`), or set --sandbox-url (env E2B_SANDBOX_URL) / run "
      "`aenv auth login`")),
    (httpx.ConnectTimeout("slow"), "API",
     ("timed out talking to the API at http://h:1 (ConnectTimeout): is the service "
      "running? (`make run`), or set --api-url / run `aenv auth login`")),
    (httpx.ReadTimeout("slow"), "sandbox proxy",
     ("timed out talking to the sandbox proxy at http://h:1 (ReadTimeout): the service did "
      "not answer in time; try again (the operation may have gone on)")),
    (httpx.RemoteProtocolError(""), "API",
     ("cannot reach the API at http://h:1 (RemoteProtocolError): is the service running? "
      "(`make run`), or set --api-url / run `aenv auth login`")),
], ids=["refused", "proxy-dns", "connect-timeout", "read-timeout", "protocol"])
def test_transport_errors(exc: Exception, what: str, line: str) -> None:
    with pytest.raises(ConnectionFailed) as info, transport_errors("http://h:1", what):
        raise exc
    assert info.value.line() == line and info.value.exit_code == 1
    assert info.value.__cause__ is exc


@pytest.mark.parametrize(("missing", "hint"), [
    ("sandbox", " (see `aenv ls`)"), ("snapshot", " (see `aenv snapshot ls`)"),
    ("template", " (see `aenv template ls`)"), (None, "")])
def test_not_found_hints(missing: str | None, hint: str) -> None:
    request = httpx.Request("GET", "http://h/x")
    resp = httpx.Response(404, json={"code": 404, "message": "gone"}, request=request)
    with pytest.raises(ApiError) as info:
        raise_for_status(resp, missing=missing)
    assert info.value.line() == f"API error 404: gone{hint}" and info.value.exit_code == 4
    # other statuses get no "where to look" hint
    resp = httpx.Response(409, json={"code": 409, "message": "busy"}, request=request)
    with pytest.raises(ApiError) as info:
        raise_for_status(resp, missing=missing)
    assert info.value.line() == "API error 409: busy" and info.value.exit_code == 5
