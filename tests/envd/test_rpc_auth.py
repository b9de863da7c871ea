"""Access-token enforcement and disconnect handling, on a private in-process envd."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from .conftest import STREAM_HEADERS, UNARY_HEADERS, envelope, split_envelopes

TOKEN = "s3cret-token"


@pytest.fixture
def token_envd(inprocess_envd):
    inprocess_envd.defaults.access_token = TOKEN
    try:
        yield inprocess_envd
    finally:
        inprocess_envd.defaults.access_token = None


def test_unary_without_token_is_unauthenticated(token_envd):
    url = f"{token_envd.url}/process.Process/List"
    r = httpx.post(url, content=b"{}", headers=UNARY_HEADERS)
    assert r.status_code == 401
    assert r.json()["code"] == "unauthenticated"
    r = httpx.post(url, content=b"{}", headers={**UNARY_HEADERS, "x-access-token": "wrong"})
    assert r.status_code == 401
    r = httpx.post(url, content=b"{}", headers={**UNARY_HEADERS, "x-access-token": TOKEN})
    assert r.status_code == 200 and "processes" in r.json() or r.json() == {}


def test_stream_without_token_is_unauthenticated_and_starts_nothing(token_envd, tmp_path):
    marker = tmp_path / "ran"
    body = envelope({"process": {"cmd": "/usr/bin/touch", "args": [str(marker)]}})
    r = httpx.post(f"{token_envd.url}/process.Process/Start", content=body,
                   headers=STREAM_HEADERS)
    assert r.status_code == 200
    (flags, payload), = split_envelopes(r.content)
    assert flags == 2 and json.loads(payload)["error"]["code"] == "unauthenticated"
    time.sleep(0.2)
    assert not marker.exists()
    r = httpx.post(f"{token_envd.url}/process.Process/Start", content=body,
                   headers={**STREAM_HEADERS, "x-access-token": TOKEN,
                            "authorization": "Basic cm9vdDo="})  # root: tmp_path is 0700
    assert split_envelopes(r.content)[-1] == (2, b"{}")
    assert marker.exists()


def test_no_token_needed_when_none_set(inprocess_envd):
    r = httpx.post(f"{inprocess_envd.url}/process.Process/List", content=b"{}",
                   headers=UNARY_HEADERS)
    assert r.status_code == 200


def test_blocked_stream_notices_disconnect(inprocess_envd):
    """A Connect stream on a silent process ends (unsubscribes) when its client leaves."""
    table = inprocess_envd.app.state.processes.table
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{inprocess_envd.url}/process.Process/Start",
                           headers=STREAM_HEADERS,
                           content=envelope({"process": {"cmd": "sleep", "args": ["30"]}})) as r:
            # Keep the iterators referenced: a discarded httpx iterator closes the response.
            chunks = r.iter_bytes()
            pid = json.loads(next(chunks)[5:])["event"]["start"]["pid"]
            proc = table.by_pid(pid)
            with client.stream("POST", f"{inprocess_envd.url}/process.Process/Connect",
                               headers=STREAM_HEADERS,
                               content=envelope({"process": {"pid": pid}})) as c:
                connect_chunks = c.iter_bytes()
                next(connect_chunks)
                time.sleep(0.3)
                assert proc.fanout.subscriber_count == 2
            _wait(lambda: proc.fanout.subscriber_count == 1)
            time.sleep(0.3)
            assert proc.fanout.subscriber_count == 1  # the Start stream is still attached
        _wait(lambda: proc.fanout.subscriber_count == 0)
        assert proc.running  # a disconnect is not a kill
        httpx.post(f"{inprocess_envd.url}/process.Process/SendSignal", headers=UNARY_HEADERS,
                   content=json.dumps({"process": {"pid": pid},
                                       "signal": "SIGNAL_SIGKILL"}).encode())
        _wait(lambda: not proc.running)
    # Reaped: no zombie left behind.
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _wait(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition not reached")
        time.sleep(0.02)
