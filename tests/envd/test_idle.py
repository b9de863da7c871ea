"""An idle envd does not wake up (envd/server.py): uvicorn's 10 Hz tick is gone, the Date
header is still on every response, and SIGTERM still stops the server at once."""

from __future__ import annotations

import email.utils
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from tests.envd.test_entropy import logged_envd


def _main_thread_wakeups(pid: int) -> int:
    for line in Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def _envd_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"envd" in cmd and port.encode() in cmd:
                return int(d.name)
    raise AssertionError(f"no envd process listening on {port}")


def test_idle_envd_sleeps_and_stamps_a_date(tmp_path: Path) -> None:
    with logged_envd(tmp_path) as envd:
        r = httpx.get(f"{envd.url}/health")
        stamped = email.utils.parsedate_to_datetime(r.headers["date"])
        assert abs((datetime.now(UTC) - stamped).total_seconds()) < 120
        assert len(r.headers.get_list("date")) == 1

        pid = _envd_pid(envd.url)
        before = _main_thread_wakeups(pid)
        time.sleep(2.0)
        woke = _main_thread_wakeups(pid) - before
        # uvicorn's own main loop woke 10 times a second (20 here)
        assert woke <= 3, f"idle envd's main thread woke {woke} times in 2 s"

        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] \
            if Path(f"/proc/{pid}").exists() else "gone"
        assert state in ("Z", "gone"), f"envd did not stop on SIGTERM (state {state})"
