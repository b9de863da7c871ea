"""`aenv nodes` (host/cli/nodes.py) against a running cluster's gateway."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from host.cli import cli
from host.cli.nodes import nodes
from tests.api.conftest import API_KEY

from .harness import Cluster
from .test_gateway import api, create


@pytest.fixture
def run(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setitem(cli.commands, "nodes", nodes)   # until the lead wires it in
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))   # no saved credentials
    for var in ("AENV_API_URL", "E2B_API_URL", "AENV_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(var, raising=False)

    def invoke(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(cli, ["--api-url", cluster.url, "--api-key", API_KEY, *args])
        return res.exit_code, res.output

    return invoke


def test_nodes_json_and_table(cluster: Cluster, run) -> None:
    with api(cluster) as c:
        create(c)
    code, out = run("nodes", "-o", "json")
    assert code == 0, out
    data = json.loads(out)
    assert sorted(n["nodeID"] for n in data) == ["node1", "node2", "node3"]
    assert sum(n["sandboxes"] for n in data) == 1
    code, out = run("nodes")
    assert code == 0, out
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["NODE", "STATE", "SANDBOXES"]
    assert [ln.split()[0] for ln in lines[1:]] == ["node1", "node2", "node3"]
    assert all(ln.split()[1] == "ready" for ln in lines[1:])
    code, out = run("nodes", "node2", "-o", "json")
    assert code == 0 and json.loads(out)["nodeID"] == "node2"


def test_nodes_errors(cluster: Cluster, run) -> None:
    code, out = run("nodes", "nope")
    assert code == 4 and "404" in out
    res = CliRunner().invoke(cli, ["--api-url", cluster.url, "--api-key", "wrong", "nodes"])
    assert res.exit_code == 3
