"""`aenv snapshot create|ls|rm` and the earlier spellings (`snapshot ID`, `snapshots`,
`rm-snapshot`) against the real REST API (sandbox lifecycle: the test double)."""

from __future__ import annotations

from .conftest import Stack


def _start(stack: Stack) -> str:
    r = stack.run("start")
    assert r.exit_code == 0, r.output
    return r.stdout.strip()


def test_create_ls_rm(stack: Stack) -> None:
    sid = _start(stack)
    other = _start(stack)
    r = stack.run("snapshot", "create", sid, "--name", "snap1")
    assert (r.exit_code, r.stdout) == (0, "team/snap1:default\n")
    assert stack.orch.snapshots["team/snap1:default"].sandbox_id == sid
    assert stack.run("snapshot", "create", other).exit_code == 0

    r = stack.run("snapshot", "ls")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["SNAPSHOT", "ID", "NAMES"] and len(lines) == 3
    r = stack.run("snapshot", "ls", "--sandbox", sid)
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["team/snap1:default"]

    assert stack.run("snapshot", "rm", "team/snap1:default").exit_code == 0
    assert "team/snap1:default" not in stack.orch.snapshots
    r = stack.run("snapshot", "rm", "team/snap1:default")
    assert r.exit_code == 4
    assert r.stderr.startswith("aenv: API error 404: ")
    assert r.stderr.endswith(" (see `aenv snapshot ls`)\n")


def test_earlier_spellings(stack: Stack) -> None:
    sid = _start(stack)
    # `aenv snapshot ID [--name N]`: create, the options before or after the id
    r = stack.run("snapshot", sid, "--name", "old")
    assert (r.exit_code, r.stdout) == (0, "team/old:default\n"), r.output
    r = stack.run("snapshot", "--name", "older", sid)
    assert (r.exit_code, r.stdout) == (0, "team/older:default\n"), r.output
    r = stack.run("snapshot", sid)
    assert r.exit_code == 0 and r.stdout.startswith("team/")

    r = stack.run("snapshots", "--sandbox", sid)
    assert r.exit_code == 0
    assert r.stdout == stack.run("snapshot", "ls", "--sandbox", sid).stdout
    assert "team/old:default" in r.stdout
    assert stack.run("rm-snapshot", "team/old:default").exit_code == 0
    assert "team/old:default" not in stack.orch.snapshots
    assert stack.run("rm-snapshot", "team/old:default").exit_code == 4

    # the earlier names work but are not offered
    r = stack.run("--help")
    commands = {line.split()[0] for line in r.stdout.split("Commands:")[1].splitlines()
                if line.strip()}
    assert "snapshot" in commands and not {"snapshots", "rm-snapshot"} & commands


def test_snapshot_of_unknown_sandbox_and_typos(stack: Stack) -> None:
    r = stack.run("snapshot", "inosuchsandbox0000000")
    assert r.exit_code == 4
    assert r.stderr == ("aenv: API error 404: sandbox 'inosuchsandbox0000000' not found "
                        "(see `aenv ls`)\n")
    # a word that is no subcommand and does not look like a sandbox id: a usage error
    r = stack.run("snapshot", "lss")
    assert r.exit_code == 2 and "No such command 'lss'" in r.stderr
    r = stack.run("snapshot")
    assert r.exit_code == 2 and "create" in r.stdout + r.stderr  # the group's usage
