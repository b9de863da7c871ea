"""The server's HTTP API on the wire (httpx): NDJSON framing, status codes, queueing,
cancellation, kernel death and restarts, sandbox env vars from envd."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import ENVD_TOKEN, KEEPALIVE_S, SANDBOX_ENVS, URL, CIServer, FakeEnvd


@pytest.fixture
def client(ci_server: CIServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=URL, timeout=60) as c:
        yield c


@pytest.fixture
def context_id(client: httpx.Client) -> Iterator[str]:
    """A fresh python context, removed afterwards."""
    r = client.post("/contexts", json={})
    assert r.status_code == 200, r.text
    cid = r.json()["id"]
    yield cid
    client.delete(f"/contexts/{cid}")


def execute(client: httpx.Client, code: str, **fields: Any) -> list[dict[str, Any]]:
    with client.stream("POST", "/execute", json={"code": code, **fields}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def kinds(lines: list[dict[str, Any]]) -> list[str]:
    return [line["type"] for line in lines if line["type"] != "keepalive"]


def wait_for(path: Path) -> str:
    """Kernel code that blocks until `path` exists (for at most a minute)."""
    return (f"import os, time\nfor _ in range(1200):\n"
            f"    if os.path.exists({str(path)!r}): break\n    time.sleep(0.05)\n")


def test_health(client: httpx.Client) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == "OK"


def test_stream_framing(client: httpx.Client, context_id: str) -> None:
    lines = execute(client, "print('h\u00e9llo \u2713')\n40 + 2", context_id=context_id)
    assert kinds(lines) == ["number_of_executions", "stdout", "result", "end_of_execution"]
    count, out, result = (x for x in lines if x["type"] != "keepalive" and "end" not in x["type"])
    assert count["execution_count"] == 1
    assert out["text"] == "h\u00e9llo \u2713\n"
    assert isinstance(out["timestamp"], int) and out["timestamp"] > 1_600_000_000 * 10**9
    assert result == {"type": "result", "text": "42", "is_main_result": True, "extra": {}}


def test_server_settings_stay_out_of_the_kernel(client: httpx.Client) -> None:
    lines = execute(client, "import os; sorted(k for k in os.environ if k.startswith('AENV_CI'))")
    assert [x["text"] for x in lines if x["type"] == "result"] == ["[]"]


def test_stream_is_ascii(client: httpx.Client, context_id: str) -> None:
    # the JS SDK decodes every chunk on its own: a multi-byte character must never be
    # split between two, so none is sent
    body = json.dumps({"code": "print('\u00e9' * 5000)", "context_id": context_id})
    with client.stream("POST", "/execute", content=body) as r:
        raw = r.read()
    assert raw.isascii()
    lines = [json.loads(line) for line in raw.splitlines()]
    assert "".join(x["text"] for x in lines if x["type"] == "stdout") == "\u00e9" * 5000 + "\n"


def test_keepalive_during_silence(client: httpx.Client, context_id: str) -> None:
    lines = execute(client, f"import time; time.sleep({KEEPALIVE_S * 2.5})",
                    context_id=context_id)
    assert {"type": "keepalive"} in lines
    assert lines[-1] == {"type": "end_of_execution"}


def test_display_data_and_extra_mime_types(client: httpx.Client, context_id: str) -> None:
    code = ("from IPython.display import display\n"
            "display({'text/plain': 'p', 'text/html': '<b>h</b>', 'application/x-custom': "
            "'c'}, raw=True)\n'done'")
    lines = execute(client, code, context_id=context_id)
    results = [line for line in lines if line["type"] == "result"]
    assert results[0] == {"type": "result", "text": "p", "html": "<b>h</b>",
                          "is_main_result": False, "extra": {"application/x-custom": "c"}}
    assert results[1]["is_main_result"] and results[1]["text"] == "done"


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"language": "python"}', 400, "'code' is required"),
    (b'{"code": "1", "env_vars": {"A": 1}}', 400, "env_vars[A]"),
    (b'{"code": "1", "env_vars": {"A=B": "1"}}', 400, "invalid variable name"),
    (b'{"code": "1", "context_id": "c", "language": "python"}', 400, "Only one of"),
    (b'{"code": "1", "language": "cobol"}', 400, "Unsupported language 'cobol'"),
    (b'{"code": "1", "context_id": "missing-ctx"}', 404, "Context missing-ctx not found"),
])
def test_execute_errors(client: httpx.Client, body: bytes, status: int, message: str) -> None:
    r = client.post("/execute", content=body)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("text/plain")
    assert message in r.text


@pytest.mark.parametrize(("method", "path", "body", "status", "message"), [
    ("POST", "/contexts", b"{", 400, "not valid JSON"),
    ("POST", "/contexts", b'{"cwd": "relative/dir"}', 400, "absolute path"),
    ("POST", "/contexts", b'{"cwd": "/no/such/dir"}', 400, "not a directory"),
    ("POST", "/contexts", b'{"language": "cobol"}', 400, "Unsupported language 'cobol'"),
    ("DELETE", "/contexts/ghost", b"", 404, "Context ghost not found"),
    ("POST", "/contexts/ghost/restart", b"", 404, "Context ghost not found"),
])
def test_context_errors(client: httpx.Client, method: str, path: str, body: bytes,
                        status: int, message: str) -> None:
    r = client.request(method, path, content=body)
    assert (r.status_code, message in r.text) == (status, True), r.text


def test_context_lifecycle(client: httpx.Client, ci_server: CIServer) -> None:
    r = client.post("/contexts", content=b"")     # an empty body means all defaults
    assert r.status_code == 200
    ctx = r.json()
    assert ctx == {"id": ctx["id"], "language": "python", "cwd": str(ci_server.home)}
    assert ctx in client.get("/contexts").json()
    assert client.post(f"/contexts/{ctx['id']}/restart").status_code == 200
    assert client.delete(f"/contexts/{ctx['id']}").status_code == 200
    assert ctx not in client.get("/contexts").json()


class Background:
    """An execution streamed on a thread; `started` is set at its first stdout line."""

    def __init__(self, code: str, context_id: str) -> None:
        self.lines: list[dict[str, Any]] = []
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(code, context_id))
        self._thread.start()

    def _run(self, code: str, context_id: str) -> None:
        try:
            with httpx.Client(base_url=URL, timeout=60) as c, c.stream(
                    "POST", "/execute", json={"code": code, "context_id": context_id}) as r:
                for raw in r.iter_lines():
                    if raw:
                        self.lines.append(json.loads(raw))
                        if self.lines[-1]["type"] == "stdout":
                            self.started.set()
        finally:
            self.started.set()

    def join(self) -> list[dict[str, Any]]:
        self._thread.join(60)
        assert not self._thread.is_alive()
        return self.lines


def test_concurrent_runs_queue_and_keep_their_outputs(context_id: str,
                                                      tmp_path: Path) -> None:
    release = tmp_path / "release"
    first = Background(f"print('first starts', flush=True)\n{wait_for(release)}"
                       "print('first ends')", context_id)
    assert first.started.wait(60)
    second = Background("print('second runs')", context_id)
    release.touch()
    results = {"first": first.join(), "second": second.join()}
    stdout = {name: [x["text"] for x in lines if x["type"] == "stdout"]
              for name, lines in results.items()}
    assert stdout == {"first": ["first starts\n", "first ends\n"],
                      "second": ["second runs\n"]}
    counts = [results[n][0]["execution_count"] for n in ("first", "second")]
    assert counts[1] == counts[0] + 1


def test_client_gone_while_queued_skips_the_run(client: httpx.Client, context_id: str,
                                                tmp_path: Path) -> None:
    release, ran = tmp_path / "release", tmp_path / "second-ran"
    blocker = Background(f"print('blocking', flush=True)\n{wait_for(release)}", context_id)
    assert blocker.started.wait(60)
    # queue a run behind the blocker, then hang up before it starts
    with httpx.Client(base_url=URL, timeout=60) as c, c.stream(
            "POST", "/execute",
            json={"code": f"open({str(ran)!r}, 'w').close()", "context_id": context_id}):
        pass
    # no signal tells when the server has seen the hang-up; it reacts to the socket
    # closing at once, this only keeps a loaded machine from racing the release
    time.sleep(0.5)
    release.touch()
    blocker.join()
    lines = execute(client, f"import os; os.path.exists({str(ran)!r})", context_id=context_id)
    assert [x["text"] for x in lines if x["type"] == "result"] == ["False"]


def test_kernel_death_ends_the_run_and_restarts(client: httpx.Client, context_id: str) -> None:
    execute(client, "before = 1", context_id=context_id)
    lines = execute(client, "import os; os._exit(3)", context_id=context_id)
    errors = [x for x in lines if x["type"] == "error"]
    assert len(errors) == 1 and errors[0]["name"] == "ContextRestarting"
    assert "exit code 3" in errors[0]["value"]
    assert lines[-1] == {"type": "end_of_execution"}
    after = execute(client, "'before' in dir()", context_id=context_id)
    assert [x["text"] for x in after if x["type"] == "result"] == ["False"]


def test_restart_ends_a_running_execution(client: httpx.Client, context_id: str) -> None:
    running = Background("print('sleeping', flush=True)\nimport time; time.sleep(60)",
                         context_id)
    assert running.started.wait(60)
    assert client.post(f"/contexts/{context_id}/restart").status_code == 200
    lines = running.join()
    assert [x["name"] for x in lines if x["type"] == "error"] == ["ContextRestarting"]
    assert lines[-1] == {"type": "end_of_execution"}
    after = execute(client, "1 + 1", context_id=context_id)
    assert [x["text"] for x in after if x["type"] == "result"] == ["2"]


def test_remove_ends_a_running_execution(client: httpx.Client) -> None:
    cid = client.post("/contexts", json={}).json()["id"]
    running = Background("print('sleeping', flush=True)\nimport time; time.sleep(60)", cid)
    assert running.started.wait(60)
    assert client.delete(f"/contexts/{cid}").status_code == 200
    lines = running.join()
    assert [(x["name"], x["value"]) for x in lines if x["type"] == "error"] == [
        ("ContextRestarting", "Context was removed")]
    assert client.post("/execute", json={"code": "1", "context_id": cid}).status_code == 404


def test_contexts_run_independently(client: httpx.Client, context_id: str,
                                    tmp_path: Path) -> None:
    release = tmp_path / "release"
    busy = Background(f"print('busy', flush=True)\n{wait_for(release)}", context_id)
    assert busy.started.wait(60)
    try:
        # the default context answers while the other one is still inside its run
        lines = execute(client, "'from the default context'")
        assert [x["text"] for x in lines if x["type"] == "result"] == [
            "from the default context"]
        assert {"type": "end_of_execution"} not in busy.lines
    finally:
        release.touch()
    assert busy.join()[-1] == {"type": "end_of_execution"}


def test_sandbox_envs_follow_envd(client: httpx.Client, context_id: str,
                                  fake_envd: FakeEnvd) -> None:
    code = "import os; print(os.environ.get('AENV_SANDBOX_VAR'), os.environ.get('AENV_NEW'))"
    try:
        lines = execute(client, code, context_id=context_id)
        assert [x["text"] for x in lines if x["type"] == "stdout"] == ["from-envd None\n"]
        fake_envd.envs = {"AENV_NEW": "added"}
        lines = execute(client, code, context_id=context_id)
        assert [x["text"] for x in lines if x["type"] == "stdout"] == ["None added\n"]
    finally:
        fake_envd.envs = dict(SANDBOX_ENVS)


def test_access_token_goes_to_envd(client: httpx.Client, context_id: str,
                                   fake_envd: FakeEnvd) -> None:
    fake_envd.tokens.clear()
    with client.stream("POST", "/execute", json={"code": "1", "context_id": context_id},
                       headers={"X-Access-Token": ENVD_TOKEN}) as r:
        r.read()
    assert fake_envd.tokens == [ENVD_TOKEN]
    # envd refusing a token leaves the context's variables as they were
    with client.stream("POST", "/execute", headers={"X-Access-Token": "wrong"}, json={
            "code": "import os; print(os.environ.get('AENV_SANDBOX_VAR'))",
            "context_id": context_id}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert [x["text"] for x in lines if x["type"] == "stdout"] == ["from-envd\n"]
