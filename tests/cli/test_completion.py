"""`aenv completion bash|zsh|fish`: the scripts load (bash: in a real bash, which then
completes through `aenv` itself), and completions answer the COMP_WORDS/COMP_CWORD
protocol the scripts speak, sandbox ids included (from the real REST API)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO_ROOT, Stack, invoke

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")


def _complete(words: str, cword: int, env: dict[str, str] | None = None) -> list[str]:
    """What `aenv` answers a bash completion request (`type,value` lines)."""
    r = subprocess.run([sys.executable, "-m", "host.cli"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=60, check=False,
                       env={**os.environ, **(env or {}), "_AENV_COMPLETE": "bash_complete",
                            "COMP_WORDS": words, "COMP_CWORD": str(cword)})
    assert r.returncode == 0, r.stderr
    return [line for line in r.stdout.splitlines() if line]


@needs_bash
def test_bash_script_loads_and_completes(tmp_path: Path) -> None:
    r = invoke("completion", "bash")
    assert r.exit_code == 0, r.output
    script = tmp_path / "aenv.bash"
    script.write_text(r.stdout)
    assert "_AENV_COMPLETE=bash_complete" in r.stdout
    # the script is what click itself prints for _AENV_COMPLETE=bash_source
    env = {**os.environ, "_AENV_COMPLETE": "bash_source"}
    direct = subprocess.run([sys.executable, "-m", "host.cli"], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    assert direct.stdout == r.stdout

    p = subprocess.run([BASH or "bash", "--norc", "-c", f"source {script} && complete -p aenv"],
                       capture_output=True, text=True, timeout=30, check=False)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "complete -o nosort -F _aenv_completion aenv"

    # bash runs the completion function, which asks `aenv` (the venv's, on PATH)
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    p = subprocess.run(
        [BASH or "bash", "--norc", "-c",
         (f'source {script} && COMP_WORDS=(aenv sn) && COMP_CWORD=1 && '
          '_aenv_completion aenv && printf "%s\\n" "${COMPREPLY[@]}"')],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PATH": path})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["snapshot"]


def test_completion_protocol() -> None:
    assert _complete("aenv sn", 1) == ["plain,snapshot"]  # not the hidden `snapshots`
    assert _complete("aenv snapshot ", 2) == ["plain,create", "plain,ls", "plain,rm"]
    assert _complete("aenv auth ", 2) == ["plain,login", "plain,logout", "plain,status"]
    assert _complete("aenv completion ", 2) == ["plain,bash", "plain,zsh", "plain,fish"]
    assert "plain,--output" in _complete("aenv ls --", 2)
    assert _complete("aenv ls -o ", 3) == ["plain,table", "plain,json"]


def test_sandbox_ids_complete(stack: Stack) -> None:
    sids = sorted(invoke(*stack.argv("start")).stdout.strip() for _ in range(2))
    env = stack.env()
    assert sorted(_complete("aenv info ", 2, env)) == [f"plain,{s}" for s in sids]
    assert _complete(f"aenv exec {sids[0][:12]}", 2, env) == [f"plain,{sids[0]}"]
    # options on the command line count too
    words = f"aenv --api-url {stack.api_url} --api-key {env['AENV_API_KEY']} kill "
    assert len(_complete(words, 6)) == 2
    # no API: no completions, and no error in the shell
    assert _complete("aenv info ", 2, {"AENV_API_URL": "http://127.0.0.1:1"}) == []


def test_zsh_and_fish_scripts() -> None:
    r = invoke("completion", "zsh")
    assert r.exit_code == 0 and "#compdef aenv" in r.stdout
    assert "compdef _aenv_completion aenv" in r.stdout
    r = invoke("completion", "fish")
    assert r.exit_code == 0
    assert "complete --no-files --command aenv --arguments" in r.stdout
    assert "_AENV_COMPLETE=fish_complete" in r.stdout
    r = invoke("completion", "tcsh")
    assert r.exit_code == 2 and "'tcsh' is not one of 'bash', 'zsh', 'fish'" in r.stderr
