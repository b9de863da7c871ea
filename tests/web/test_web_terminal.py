"""The web terminal (host/web) over the real proxy, API and envd, in a real browser.

See conftest.py for what is real. The browser session: open the link, type, read the
screen, resize, screenshot, pause + resume the sandbox and type again.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import websockets

from host.web.links import TerminalLinks
from host.web.terminal import COOKIE
from tests.api.conftest import API_KEY
from tests.api.double import FakeOrchestrator
from tests.web.conftest import Site
from tests.web.page import TerminalPage

ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"


def _open(site: Site, sid: str) -> httpx.Client:
    """A client holding the page's cookie, as a browser does after the link."""
    client = httpx.Client(base_url=site.proxy_url)
    r = client.get(site.link(sid))
    assert r.status_code == 303, r.text
    return client


# --- links and the page ----------------------------------------------------------------

def test_api_mints_a_link_that_opens_the_page(site: Site) -> None:
    sid = site.orch.add().sandbox_id
    r = httpx.post(f"{site.api_url}/sandboxes/{sid}/terminal", json={"ttl": 120},
                   headers={"X-API-Key": API_KEY})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["url"].startswith(f"{site.proxy_url}/terminal/{sid}?token=")
    expires = datetime.fromisoformat(body["expiresAt"]).timestamp()
    assert 100 < expires - time.time() <= 121

    with httpx.Client() as client:
        r = client.get(body["url"])
        # the token leaves the address bar; the page keeps it in a strict, HttpOnly cookie
        assert r.status_code == 303 and r.headers["location"] == f"/terminal/{sid}"
        cookie = r.headers["set-cookie"]
        for attr in ("HttpOnly", "SameSite=strict", f"Path=/terminal/{sid}"):
            assert attr.lower() in cookie.lower(), cookie
        page = client.get(f"{site.proxy_url}/terminal/{sid}")
        assert page.status_code == 200
        assert f"<code id=\"sandbox\">{sid}</code>" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["cache-control"] == "no-store"


def test_api_refuses_bad_link_requests(site: Site) -> None:
    sid = site.orch.add().sandbox_id
    url = f"{site.api_url}/sandboxes/{sid}/terminal"
    assert httpx.post(url, json={}).status_code == 401
    r = httpx.post(url, json={"ttl": 1}, headers={"X-API-Key": API_KEY})
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.post(f"{site.api_url}/sandboxes/nosuchsandbox/terminal", json={},
                   headers={"X-API-Key": API_KEY})
    assert r.status_code == 404 and r.json()["code"] == 404


def test_page_needs_a_valid_link_or_key(site: Site) -> None:
    sid = site.orch.add().sandbox_id
    other = site.orch.add().sandbox_id
    page = f"{site.proxy_url}/terminal/{sid}"
    assert httpx.get(page).status_code == 401
    assert httpx.get(page, params={"token": "123.abc"}).status_code == 401
    token, _ = site.links.token(other)
    assert httpx.get(page, params={"token": token}).status_code == 401  # another sandbox's
    old = TerminalLinks(site.links._secret, clock=lambda: time.time() - 3600)
    expired, _ = old.token(sid, 60)
    r = httpx.get(page, params={"token": expired})
    assert r.status_code == 401 and "aenv terminal --web" in r.text
    assert httpx.get(page, headers={"X-API-Key": "wrong"}).status_code == 401
    r = httpx.get(page, headers={"X-API-Key": API_KEY})
    assert r.status_code == 200 and COOKIE in r.headers["set-cookie"]
    token, _ = site.links.token("nosuchsandbox")
    assert httpx.get(f"{site.proxy_url}/terminal/nosuchsandbox",
                     params={"token": token}).status_code == 404


def test_static_files_and_no_traversal(site: Site) -> None:
    r = httpx.get(f"{site.proxy_url}/terminal/_static/vendor/xterm.mjs")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert "Terminal" in r.text
    assert httpx.get(f"{site.proxy_url}/terminal/_static/terminal.js").status_code == 200
    for bad in ("/terminal/_static/../terminal.py", "/terminal/_static/%2e%2e/links.py",
                "/terminal/_static/..%2flinks.py"):
        r = httpx.get(f"{site.proxy_url}{bad}")
        assert r.status_code in (401, 404) and "import" not in r.text, bad


def test_sandbox_hosts_keep_their_terminal_paths(site: Site, orch: FakeOrchestrator) -> None:
    """`/terminal/...` on a sandbox's own host (or routed by headers) is the sandbox's."""
    sid = orch.add().sandbox_id
    r = httpx.get(f"{site.proxy_url}/terminal/{sid}",
                  headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
    assert "aenv terminal" not in r.text  # envd answered, not the page
    assert ("route", (sid, 49983, True)) in orch.calls


def test_status_follows_the_sandbox(site: Site, orch: FakeOrchestrator) -> None:
    sid = orch.add().sandbox_id
    client = _open(site, sid)
    try:
        assert client.get(f"/terminal/{sid}/status").json() == {"state": "running"}
        asyncio.run(orch.pause(sid))
        assert client.get(f"/terminal/{sid}/status").json() == {"state": "paused"}
        client.cookies.clear()
        assert client.get(f"/terminal/{sid}/status").status_code == 401
    finally:
        client.close()


def test_websocket_needs_the_cookie_and_the_page_origin(site: Site) -> None:
    sid = site.orch.add().sandbox_id
    ws_url = site.proxy_url.replace("http://", "ws://") + f"/terminal/{sid}/ws?cols=80&rows=24"
    token, _ = site.links.token(sid)

    async def close_code(headers: dict[str, str]) -> int | None:
        async with websockets.connect(ws_url, additional_headers=headers,
                                      open_timeout=10) as ws:
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    assert asyncio.run(close_code({})) == 4401
    assert asyncio.run(close_code({"Cookie": f"{COOKIE}=1.bad"})) == 4401
    assert asyncio.run(close_code({"Cookie": f"{COOKIE}={site.links.token('x')[0]}"})) == 4401
    evil = {"Cookie": f"{COOKIE}={token}", "Origin": "http://evil.example"}
    with pytest.raises(websockets.InvalidStatus) as refused:  # no handshake at all
        asyncio.run(close_code(evil))
    assert refused.value.response.status_code == 403

    async def shell_answers() -> bytes:
        headers = {"Cookie": f"{COOKIE}={token}", "Origin": site.proxy_url}
        async with websockets.connect(ws_url, additional_headers=headers) as ws:
            await ws.send(b"echo web''socket-ok\n")
            seen = b""
            while b"websocket-ok\r\n" not in seen:
                frame = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(frame, bytes):
                    seen += frame
            return seen

    assert b"websocket-ok" in asyncio.run(shell_answers())


# --- in the browser --------------------------------------------------------------------

def test_browser_session_types_resizes_and_survives_pause(site: Site, orch: FakeOrchestrator,
                                                          browser, tmp_path: Path) -> None:
    sid = orch.add().sandbox_id
    context = browser.new_context(viewport={"width": 900, "height": 500})
    try:
        page = context.new_page()
        page.goto(site.link(sid))
        assert page.url == f"{site.proxy_url}/terminal/{sid}"  # the token was dropped
        term = TerminalPage(page)
        assert term.wait_state("connected") == "connected"

        term.type("echo hi")
        screen = term.wait_line("hi")
        assert any(line.rstrip().endswith("echo hi") for line in screen)

        cols, rows = term.size()
        page.set_viewport_size({"width": 1300, "height": 800})
        page.wait_for_function(f"() => window.aenvTerminal.term.cols > {cols}")
        new_cols, new_rows = term.size()
        assert new_rows > rows
        # the PTY got the new size: the shell reports what xterm.js fitted
        term.run("stty size", "size-done")
        assert f"{new_rows} {new_cols}" in [line.strip() for line in term.screen()]

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "web-terminal-host.png"
        page.screenshot(path=str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000

        api = {"X-API-Key": API_KEY}
        r = httpx.post(f"{site.api_url}/sandboxes/{sid}/pause", headers=api)
        assert r.status_code == 204, r.text
        assert term.wait_state("waiting", "disconnected") in ("waiting", "disconnected")
        page.wait_for_function("() => document.body.dataset.state === 'waiting'")
        assert "paused" in page.inner_text("#status")
        r = httpx.post(f"{site.api_url}/sandboxes/{sid}/connect", json={"timeout": 60},
                       headers=api)
        assert r.status_code == 201, r.text
        term.wait_state("connected")
        assert "session 2" in page.inner_text("#status")
        term.run("echo again", "after-resume")
    finally:
        context.close()
