"""The web terminal against a real VM, in headless chromium: the link the API mints (what
`aenv terminal --web` prints) opens a page whose xterm.js talks to the guest's envd
through the proxy. Typing, resize, screenshot, and a session after pause + resume (the
shell's files are there; processes of the first session were ended with its socket).
"""

from __future__ import annotations

import httpx
import pytest
from e2b import Sandbox

from tests.web.conftest import browser  # noqa: F401 - fixture
from tests.web.page import TerminalPage
from tests.web.test_web_terminal import ARTIFACTS

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def test_web_terminal_on_a_vm_across_pause_and_resume(env: E2EService, browser) -> None:  # noqa: F811
    sbx = Sandbox.create(timeout=600)
    context = browser.new_context(viewport={"width": 1000, "height": 560})
    try:
        with env.client() as api:
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/terminal", json={"ttl": 900})
            assert r.status_code == 201, r.text
            link = r.json()["url"]
        assert link.startswith(f"{env.sandbox_url}/terminal/{sbx.sandbox_id}?token=")
        page = context.new_page()
        page.goto(link)
        term = TerminalPage(page)
        term.wait_state("connected")

        term.type("echo hi")
        term.wait_line("hi")
        term.run("uname -r; echo web > /home/user/from-the-page", "typed-in-vm")
        assert any(line.strip().endswith("-aenv") for line in term.screen())

        cols, rows = term.size()
        page.set_viewport_size({"width": 1400, "height": 860})
        page.wait_for_function(f"() => window.aenvTerminal.term.cols > {cols}")
        new_cols, new_rows = term.size()
        assert new_rows > rows
        term.run("stty size", "size-done")
        assert f"{new_rows} {new_cols}" in [line.strip() for line in term.screen()]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "web-terminal-vm.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"\nweb terminal screenshot: {shot}")

        assert sbx.pause() is True
        page.wait_for_function("() => document.body.dataset.state === 'waiting'",
                               timeout=120_000)
        assert "paused" in page.inner_text("#status")
        Sandbox.connect(sbx.sandbox_id, timeout=600)
        term.wait_state("connected", timeout_s=180)
        assert "session 2" in page.inner_text("#status")
        screen = term.run("cat /home/user/from-the-page", "after-resume")
        assert "web" in [line.strip() for line in screen]
    finally:
        context.close()
        with httpx.Client() as c:
            c.delete(f"{env.api_url}/sandboxes/{sbx.sandbox_id}",
                     headers={"X-API-Key": env.api_key})
