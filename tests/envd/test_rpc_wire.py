"""Raw Connect protocol checks against the shared envd (httpx, no SDK)."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest

from .conftest import STREAM_HEADERS, UNARY_HEADERS, envelope, split_envelopes

END_OK = b"\x02\x00\x00\x00\x02{}"
ROOT = "Basic " + base64.b64encode(b"root:").decode()


def start(url: str, process: dict, *, headers: dict | None = None, timeout: float = 30, **extra):
    body = envelope({"process": process, **extra})
    r = httpx.post(f"{url}/process.Process/Start", content=body,
                   headers={**STREAM_HEADERS, **(headers or {})}, timeout=timeout)
    return r, split_envelopes(r.content)


def messages(frames):
    return [json.loads(p) for f, p in frames if f == 0]


def unary(url: str, method: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/process.Process/{method}", content=content,
                      headers={**UNARY_HEADERS, **kw.pop("headers", {})}, timeout=30, **kw)


def kill(url: str, pid: int) -> None:
    unary(url, "SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})


def test_start_stream_framing_and_events(envd_url):
    r, frames = start(envd_url, {"cmd": "/bin/sh", "args": ["-c", "printf out; printf err >&2; exit 3"]})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/connect+json"
    assert r.content.endswith(END_OK)
    assert frames[-1] == (2, b"{}")
    msgs = messages(frames)
    assert set(msgs[0]["event"]) == {"start"} and msgs[0]["event"]["start"]["pid"] > 0
    out = b"".join(base64.b64decode(m["event"]["data"]["stdout"])
                   for m in msgs if "stdout" in m["event"].get("data", {}))
    err = b"".join(base64.b64decode(m["event"]["data"]["stderr"])
                   for m in msgs if "stderr" in m["event"].get("data", {}))
    assert (out, err) == (b"out", b"err")
    assert msgs[-1]["event"]["end"] == {"exitCode": 3, "exited": True,
                                        "status": "exit status 3", "error": "exit status 3"}


def test_successful_end_event_omits_error(envd_url):
    _, frames = start(envd_url, {"cmd": "/bin/true"})
    assert messages(frames)[-1]["event"]["end"] == {"exited": True, "status": "exit status 0"}


def test_unknown_rpc_path_is_404(envd_url):
    r = unary(envd_url, "NoSuchMethod", {})
    assert r.status_code == 404


def test_malformed_json_is_invalid_argument(envd_url):
    r = unary(envd_url, "SendSignal", b'{"process": {"pid": "not-a-number"')
    assert r.status_code == 400
    assert r.json()["code"] == "invalid_argument"
    r = unary(envd_url, "SendSignal", {"process": {"pid": [1, 2]}})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_malformed_stream_request_is_invalid_argument(envd_url):
    r = httpx.post(f"{envd_url}/process.Process/Start", content=envelope(b"{nope"),
                   headers=STREAM_HEADERS)
    assert r.status_code == 200
    (flags, payload), = split_envelopes(r.content)
    assert flags == 2 and json.loads(payload)["error"]["code"] == "invalid_argument"


def test_wrong_content_type_is_415(envd_url):
    r = httpx.post(f"{envd_url}/process.Process/List", content=b"{}",
                   headers={"content-type": "text/plain", "connect-protocol-version": "1"})
    assert r.status_code == 415


def test_get_is_refused(envd_url):
    r = httpx.get(f"{envd_url}/process.Process/List")
    assert r.status_code in (405, 415)


def test_unknown_pid_is_not_found(envd_url):
    r = unary(envd_url, "SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404
    assert r.json() == {"code": "not_found", "message": "process with pid 999999 not found"}
    r = httpx.post(f"{envd_url}/process.Process/Connect",
                   content=envelope({"process": {"pid": 999999}}), headers=STREAM_HEADERS)
    (flags, payload), = split_envelopes(r.content)
    assert flags == 2
    assert json.loads(payload)["error"] == {"code": "not_found",
                                            "message": "process with pid 999999 not found"}


def test_unknown_user_is_unauthenticated(envd_url):
    auth = "Basic " + base64.b64encode(b"nosuchuser:").decode()
    _, frames = start(envd_url, {"cmd": "/bin/true"}, headers={"authorization": auth})
    (flags, payload), = frames
    assert flags == 2
    assert json.loads(payload)["error"] == {"code": "unauthenticated",
                                            "message": "invalid username: 'nosuchuser'"}


def test_bad_cwd_is_invalid_argument(envd_url):
    _, frames = start(envd_url, {"cmd": "/bin/true", "cwd": "/definitely/not/here"})
    (flags, payload), = frames
    assert flags == 2 and json.loads(payload)["error"]["code"] == "invalid_argument"


def test_keepalives_follow_start_on_idle_stream(envd_url):
    t0 = time.monotonic()
    _, frames = start(envd_url, {"cmd": "/bin/sh", "args": ["-c", "sleep 2.3; echo x"]},
                      headers={"keepalive-ping-interval": "1"})
    assert time.monotonic() - t0 >= 2.2
    msgs = messages(frames)
    kinds = [next(iter(m["event"])) for m in msgs]
    assert kinds[0] == "start"
    assert 2 <= kinds.count("keepalive") <= 3, kinds  # ~1 s apart over ~2.3 s of silence
    assert kinds[-1] == "end"
    assert msgs[kinds.index("keepalive")]["event"]["keepalive"] == {}


def test_no_keepalives_with_default_interval(envd_url):
    _, frames = start(envd_url, {"cmd": "/bin/sh", "args": ["-c", "sleep 1.2"]})
    assert [next(iter(m["event"])) for m in messages(frames)] == ["start", "end"]


def test_list_has_config_and_tag(envd_url):
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{envd_url}/process.Process/Start", headers=STREAM_HEADERS,
                           content=envelope({"process": {"cmd": "sleep", "args": ["30"],
                                                         "envs": {"A": "b"}},
                                             "tag": "wire-tag"})) as r:
            first = next(r.iter_bytes())
            pid = json.loads(first[5:])["event"]["start"]["pid"]
        try:
            procs = unary(envd_url, "List", {}).json()["processes"]
            mine = [p for p in procs if p["pid"] == pid]
            assert mine == [{"config": {"cmd": "sleep", "args": ["30"], "envs": {"A": "b"}},
                             "pid": pid, "tag": "wire-tag"}]
            assert all("config" in p for p in procs)
            # Connect by tag attaches to the same process.
            with client.stream("POST", f"{envd_url}/process.Process/Connect",
                               headers=STREAM_HEADERS,
                               content=envelope({"process": {"tag": "wire-tag"}})) as c:
                first = next(c.iter_bytes())
                assert json.loads(first[5:]) == {"event": {"start": {"pid": pid}}}
        finally:
            kill(envd_url, pid)


def test_unary_deadline_is_enforced(envd_url):
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{envd_url}/process.Process/Start", headers=STREAM_HEADERS,
                           content=envelope({"process": {"cmd": "sleep", "args": ["30"]}})) as r:
            pid = json.loads(next(r.iter_bytes())[5:])["event"]["start"]["pid"]
        try:
            # Nobody reads stdin, so a 4 MiB write blocks on the full pipe until the deadline.
            data = base64.b64encode(b"x" * (4 << 20)).decode()
            t0 = time.monotonic()
            resp = unary(envd_url, "SendInput",
                         {"process": {"pid": pid}, "input": {"stdin": data}},
                         headers={"connect-timeout-ms": "500"})
            assert resp.status_code == 504, resp.text
            assert resp.json()["code"] == "deadline_exceeded"
            assert 0.4 < time.monotonic() - t0 < 5
        finally:
            kill(envd_url, pid)


def test_client_stream_deadline_is_enforced(envd_url):
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{envd_url}/process.Process/Start", headers=STREAM_HEADERS,
                           content=envelope({"process": {"cmd": "cat"}})) as r:
            pid = json.loads(next(r.iter_bytes())[5:])["event"]["start"]["pid"]

        def body():
            yield envelope({"start": {"process": {"pid": pid}}})
            yield envelope({"keepalive": {}})
            time.sleep(2.0)  # keep the request open past the deadline
            yield envelope({"data": {"input": {"stdin": "eA=="}}})

        try:
            t0 = time.monotonic()
            resp = client.post(f"{envd_url}/process.Process/StreamInput", content=body(),
                               headers={**STREAM_HEADERS, "connect-timeout-ms": "500"})
            frames = split_envelopes(resp.content)
            assert frames[-1][0] == 2
            assert json.loads(frames[-1][1])["error"]["code"] == "deadline_exceeded"
            assert time.monotonic() - t0 < 5
        finally:
            kill(envd_url, pid)


def test_stream_input_requires_start_first(envd_url):
    resp = httpx.post(f"{envd_url}/process.Process/StreamInput",
                      content=envelope({"data": {"input": {"stdin": "eA=="}}}),
                      headers=STREAM_HEADERS)
    assert json.loads(split_envelopes(resp.content)[-1][1])["error"]["code"] == \
        "failed_precondition"


def test_process_lifetime_is_the_start_timeout(envd_url):
    t0 = time.monotonic()
    _, frames = start(envd_url, {"cmd": "sleep", "args": ["30"]},
                      headers={"connect-timeout-ms": "700"})
    assert time.monotonic() - t0 < 5
    (flags, payload) = frames[-1]
    assert flags == 2 and json.loads(payload)["error"]["code"] == "deadline_exceeded"
    pid = messages(frames)[0]["event"]["start"]["pid"]
    _wait_gone(envd_url, pid)


def _wait_gone(url: str, pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p["pid"] for p in unary(url, "List", {}).json().get("processes", [])]
        if pid not in pids:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} still listed")


def test_disconnect_neither_kills_nor_blocks_the_process(envd_url, tmp_path):
    marker = tmp_path / "done"
    script = f"head -c 20000000 /dev/zero; echo ok > {marker}"
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{envd_url}/process.Process/Start",
            headers={**STREAM_HEADERS, "authorization": ROOT},  # tmp_path is 0700
            content=envelope({"process": {"cmd": "/bin/sh", "args": ["-c", script]},
                              "stdin": False})) as r:
        pid = json.loads(next(r.iter_bytes())[5:])["event"]["start"]["pid"]
    # The reader left after the start event; 20 MB of output must not stall the process.
    deadline = time.monotonic() + 15
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "process blocked on its output after the client left"
    _wait_gone(envd_url, pid)


def test_close_stdin_releases_a_blocked_writer(envd_url):
    import threading

    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{envd_url}/process.Process/Start", headers=STREAM_HEADERS,
            content=envelope({"process": {"cmd": "sleep", "args": ["30"]}})) as r:
        chunks = r.iter_bytes()
        pid = json.loads(next(chunks)[5:])["event"]["start"]["pid"]
    try:
        data = base64.b64encode(b"x" * (4 << 20)).decode()
        result: list[httpx.Response] = []
        writer = threading.Thread(target=lambda: result.append(unary(
            envd_url, "SendInput", {"process": {"pid": pid}, "input": {"stdin": data}})))
        writer.start()
        time.sleep(0.5)
        assert writer.is_alive()  # blocked: nobody reads the pipe
        assert unary(envd_url, "CloseStdin", {"process": {"pid": pid}}).status_code == 200
        writer.join(5)
        assert not writer.is_alive()
        assert result[0].json()["code"] == "failed_precondition"
    finally:
        kill(envd_url, pid)


def test_grpc_is_refused_and_the_connection_stays_usable(envd_url):
    """A gRPC content type gets a 415 with a Connect error body, not connectrpc's 500
    about trailers; the request body is read first, so the next request on the same
    keep-alive connection works (it was reset before; found by tests/e2e/test_fuzz.py)."""
    import httpx

    with httpx.Client(base_url=envd_url, timeout=30) as http:
        for _ in range(3):
            r = http.post("/filesystem.Filesystem/Stat", content=b"\x00\x00\x00\x00\x02{}" * 50,
                          headers={"content-type": "application/grpc+proto"})
            assert r.status_code == 415 and r.json()["code"] == "unimplemented"
            ok = http.post("/filesystem.Filesystem/Stat", json={"path": "/"},
                           headers={"connect-protocol-version": "1",
                                    "Authorization": "Basic dXNlcjo="})
            assert ok.status_code == 200, ok.text
