"""Unit tests of envd.rpc's error table, codecs and keepalive helper (no server)."""

from __future__ import annotations

import asyncio
import errno

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from envd import rpc
from envd.auth import AuthError
from envd.spec.process import process_pb as pb
from envd.users import UnknownUserError


@pytest.mark.parametrize("exc, code", [
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x"), Code.NOT_FOUND),
    (PermissionError(errno.EACCES, "Permission denied", "/x"), Code.PERMISSION_DENIED),
    (FileExistsError(errno.EEXIST, "File exists", "/x"), Code.ALREADY_EXISTS),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/x"), Code.INVALID_ARGUMENT),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/x"), Code.INVALID_ARGUMENT),
    (OSError(errno.ENOSPC, "No space left on device"), Code.RESOURCE_EXHAUSTED),
    (OSError(errno.EIO, "Input/output error"), Code.INTERNAL),
    (AuthError("missing access token"), Code.UNAUTHENTICATED),
    (UnknownUserError("bob"), Code.UNAUTHENTICATED),
    (RuntimeError("secret internals"), Code.INTERNAL),
    (TimeoutError(), Code.DEADLINE_EXCEEDED),
])
def test_error_table(exc, code):
    err = rpc.to_connect_error(exc)
    assert isinstance(err, ConnectError) and err.code is code


def test_error_messages():
    assert rpc.to_connect_error(UnknownUserError("bob")).message == "invalid username: 'bob'"
    msg = rpc.to_connect_error(FileNotFoundError(errno.ENOENT, "No such file or directory",
                                                 "/x")).message
    assert msg == "no such file or directory: /x"
    # Unexpected exceptions do not leak their text.
    assert "secret" not in rpc.to_connect_error(RuntimeError("secret internals")).message
    original = ConnectError(Code.ABORTED, "keep me")
    assert rpc.to_connect_error(original) is original


def test_map_errors_context_manager():
    with pytest.raises(ConnectError) as info, rpc.map_errors():
        raise FileExistsError(errno.EEXIST, "File exists", "/y")
    assert info.value.code is Code.ALREADY_EXISTS


def test_strict_codec_rejects_malformed_json():
    json_codec = next(c for c in rpc.codecs() if c.name() == "json")
    assert json_codec.decode(b'{"process":{"pid":3}}', pb.ConnectRequest).process.selector
    for bad in (b"{", b'{"process": {"pid": "x"}}', b"\xff\xfe"):
        with pytest.raises(ConnectError) as info:
            json_codec.decode(bad, pb.ConnectRequest)
        assert info.value.code is Code.INVALID_ARGUMENT


def test_exports():
    for name in rpc.__all__:
        assert hasattr(rpc, name), name
    assert {"interceptors", "codecs", "DisconnectMiddleware", "request_user",
            "next_or_disconnect", "with_keepalive"} <= set(rpc.__all__)


async def test_with_keepalive_ticks_only_when_idle():
    async def source():
        yield "a"
        await asyncio.sleep(0.35)
        yield "b"
        yield "c"

    got = [item async for item in rpc.with_keepalive(source(), interval_s=0.15,
                                                     keepalive=lambda: "ka")]
    assert got[0] == "a" and got[-2:] == ["b", "c"]
    assert got.count("ka") == 2  # ticks at ~0.15 and ~0.30, reset by every item


async def test_wait_or_disconnect_timeout_and_plain_value():
    assert await rpc.wait_or_disconnect(asyncio.sleep(0, result=5)) == 5
    with pytest.raises(TimeoutError):
        await rpc.wait_or_disconnect(asyncio.Event().wait(), timeout_s=0.05)
