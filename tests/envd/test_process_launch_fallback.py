"""envd runs the SDKs' `/bin/bash -l -c` through `/bin/sh` where an image has no bash."""

from __future__ import annotations

import pytest

from envd.services.process import launch


def test_bash_falls_back_to_sh_only_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    exists = {"/bin/sh"}
    monkeypatch.setattr(launch.os.path, "exists", lambda p: p in exists)
    assert launch.program("/bin/bash") == "/bin/sh"
    assert launch.program("/usr/bin/python3") == "/usr/bin/python3"
    exists.add("/bin/bash")
    assert launch.program("/bin/bash") == "/bin/bash"
    exists.clear()
    assert launch.program("/bin/bash") == "/bin/bash"  # then the start fails as before
