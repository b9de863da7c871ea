"""Sandbox defaults (/init: env vars, workdir, user) as seen by started processes."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from .conftest import STREAM_HEADERS, envelope, split_envelopes


@pytest.fixture
def defaults(inprocess_envd):
    d = inprocess_envd.defaults
    saved = (dict(d.env_vars), d.workdir, d.user)
    yield d
    d.env_vars, d.workdir, d.user = saved


def run(url: str, script: str, *, envs: dict | None = None, headers: dict | None = None) -> str:
    process: dict = {"cmd": "/bin/sh", "args": ["-c", script]}
    if envs:
        process["envs"] = envs
    r = httpx.post(f"{url}/process.Process/Start", content=envelope({"process": process}),
                   headers={**STREAM_HEADERS, **(headers or {})}, timeout=30)
    out = b""
    for flags, payload in split_envelopes(r.content):
        msg = json.loads(payload)
        if flags == 2:
            assert msg == {}, msg
        elif "stdout" in msg["event"].get("data", {}):
            out += base64.b64decode(msg["event"]["data"]["stdout"])
    return out.decode()


def test_env_vars_workdir_and_precedence(inprocess_envd, defaults):
    defaults.env_vars = {"SBX_VAR": "from-init", "OVERRIDE": "init"}
    defaults.workdir = "/tmp"
    out = run(inprocess_envd.url, 'echo "$SBX_VAR $OVERRIDE $HOME $USER"; pwd',
              envs={"OVERRIDE": "request"})
    assert out == "from-init request /home/user user\n/tmp\n"


def test_default_user_follows_defaults(inprocess_envd, defaults):
    defaults.user = "root"
    assert run(inprocess_envd.url, "id -un; echo $HOME") == "root\n/root\n"
    user_auth = "Basic " + base64.b64encode(b"user:").decode()
    assert run(inprocess_envd.url, "id -un", headers={"authorization": user_auth}) == "user\n"


def test_envd_environment_does_not_leak(inprocess_envd, monkeypatch):
    monkeypatch.setenv("ENVD_PRIVATE_SECRET", "leak")
    assert run(inprocess_envd.url, 'echo "[$ENVD_PRIVATE_SECRET]"') == "[]\n"
