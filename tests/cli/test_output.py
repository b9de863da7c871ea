"""`-o table|json` on every listing and info command, against the real REST API (sandbox
lifecycle: the test double). JSON output is parsed: stdout holds one JSON document and
nothing else; `--json` (hidden) is the earlier spelling of `-o json`, `-o text` of
`-o table`. The template listing is checked in test_templates.py, `auth status` in
test_auth.py."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from host.cli import cli

from .conftest import REPO_ROOT, Stack


def _start(stack: Stack, *args: str) -> str:
    r = stack.run("start", *args)
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def _json(stack: Stack, *args: str) -> object:
    """Run with -o json, and with --json: the same document, alone on stdout."""
    r = stack.run(*args, "-o", "json")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    value = json.loads(r.stdout)
    r2 = stack.run(*args, "--json")
    assert r2.exit_code == 0 and json.loads(r2.stdout) == value
    return value


def test_every_listing_has_json(stack: Stack) -> None:
    created = json.loads(stack.run("start", "--metadata", "k=v", "-o", "json").stdout)
    sid = created["sandboxID"]
    assert created["envdAccessToken"] == "envd-token"
    paused = _start(stack)
    assert stack.run("pause", paused).exit_code == 0
    assert stack.run("snapshot", "create", sid, "--name", "s1").exit_code == 0

    listed = _json(stack, "ls")
    assert isinstance(listed, list)
    assert {i["sandboxID"]: i["state"] for i in listed} == {sid: "running", paused: "paused"}
    detail = _json(stack, "info", sid)
    assert isinstance(detail, dict) and detail["metadata"] == {"k": "v"}
    logs = _json(stack, "logs", sid)
    assert isinstance(logs, list) and {e["level"] for e in logs} >= {"info", "error"}
    metrics = _json(stack, "metrics", sid)
    assert isinstance(metrics, list) and len(metrics) == 3 and "cpuUsedPct" in metrics[0]
    snaps = _json(stack, "snapshot", "ls")
    assert snaps == [{"snapshotID": "team/s1:default", "names": ["team/s1:default"]}]
    assert _json(stack, "snapshots", "--sandbox", sid) == snaps
    snap = json.loads(stack.run("snapshot", "create", sid, "-o", "json").stdout)
    assert snap["snapshotID"].startswith("team/") and snap["snapshotID"] != "team/s1:default"


def test_tables(stack: Stack) -> None:
    sid = _start(stack, "--metadata", "owner=me", "--metadata", "a=b")
    r = stack.run("ls", "-o", "table")
    assert r.exit_code == 0
    header, row = r.stdout.splitlines()
    assert header.split() == ["SANDBOX", "ID", "TEMPLATE", "STATE", "STARTED", "ENDS",
                              "METADATA"]
    cells = row.split()
    assert cells[0] == sid and cells[2] == "running" and cells[-1] == "a=b,owner=me"
    # columns line up: each cell starts where its header does
    assert row.index("running") == header.index("STATE")
    assert "\x1b[" not in r.output and not any(line != line.rstrip() for line in
                                                r.stdout.splitlines())
    assert stack.run("ls", "-o", "text").stdout == r.stdout  # the earlier spelling

    r = stack.run("info", sid)
    assert f"sandboxID: {sid}" in r.stdout.splitlines()
    assert 'metadata: {"a": "b", "owner": "me"}' in r.stdout
    assert "envd-token" not in r.stdout

    r = stack.run("ls", "-o", "yaml")
    assert r.exit_code == 2 and "'yaml' is not one of 'table', 'json'" in r.stderr


def test_json_alias_is_hidden(stack: Stack) -> None:
    for args in (("ls",), ("info",), ("snapshot", "ls"), ("template", "ls"), ("auth", "status"),
                 ("start",), ("fork",), ("logs",), ("metrics",)):
        r = stack.run(*args, "--help")
        assert r.exit_code == 0, args
        assert "-o, --output [table|json]" in r.stdout and "--json" not in r.stdout, args


@pytest.mark.skipif(sys.platform != "linux", reason="needs a Linux pty")
def test_table_on_a_terminal_is_styled(stack: Stack) -> None:
    """On a terminal the header is bold and states coloured; the text is the same."""
    sid = _start(stack)
    master, slave = pty.openpty()
    env = {**os.environ, **stack.env(), "TERM": "xterm-256color"}
    proc = subprocess.run([sys.executable, "-m", "host.cli", "ls"], cwd=REPO_ROOT, env=env,
                          stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.PIPE,
                          timeout=60, check=False)
    os.close(slave)
    try:
        out = os.read(master, 65536).decode()
    finally:
        os.close(master)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[1mSANDBOX ID" in out and "\x1b[32mrunning" in out and sid in out


def test_no_subcommand_is_usage(stack: Stack) -> None:
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, ["nosuchcommand"])
    assert r.exit_code == 2 and "No such command 'nosuchcommand'" in r.stderr
