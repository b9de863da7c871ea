"""Drive the web terminal page in Playwright: wait for its state, type, read the screen.
Shared by tests/web and tests/e2e/test_web_terminal.py.

The page's CSP forbids eval: every predicate is given in function form ("() => ..."),
which Playwright calls through the DevTools protocol, never as an evaluated string."""

from __future__ import annotations

import time
from typing import Any

WAIT_S = 60.0  # generous: a TCG guest under load answers slowly; never an upper bound asserted


class TerminalPage:
    def __init__(self, page: Any) -> None:
        self.page = page

    @property
    def state(self) -> str:
        return str(self.page.evaluate("() => document.body.dataset.state"))

    def wait_state(self, *states: str, timeout_s: float = WAIT_S) -> str:
        self.page.wait_for_function(
            "states => states.includes(document.body.dataset.state)", arg=list(states),
            timeout=timeout_s * 1000)
        return self.state

    def screen(self) -> list[str]:
        return list(self.page.evaluate("() => window.aenvTerminal.screen()"))

    def size(self) -> tuple[int, int]:
        cols, rows = self.page.evaluate(
            "() => [window.aenvTerminal.term.cols, window.aenvTerminal.term.rows]")
        return int(cols), int(rows)

    def type(self, text: str) -> None:
        self.page.locator(".xterm-helper-textarea").focus()
        self.page.keyboard.type(text)
        self.page.keyboard.press("Enter")

    def wait_line(self, text: str, timeout_s: float = WAIT_S) -> list[str]:
        """The screen once one of its lines, stripped, equals `text`."""
        deadline = time.monotonic() + timeout_s
        while True:
            screen = self.screen()
            if any(line.strip() == text for line in screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on the screen:\n" + "\n".join(screen))
            time.sleep(0.1)

    def run(self, command: str, marker: str, timeout_s: float = WAIT_S) -> list[str]:
        """Type `command; echo MARKER` and wait for MARKER's line (computed by the shell,
        so the echoed command line itself never matches)."""
        half = len(marker) // 2
        self.type(f"{command}; echo {marker[:half]}''{marker[half:]}")
        return self.wait_line(marker, timeout_s)
