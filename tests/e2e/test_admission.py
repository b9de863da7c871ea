"""Admission control on a real service (issue 14 item 14): started with
`--max-sandboxes 1`, a second create is refused with E2B's capacity error, which both
the REST API (429, `sandbox_capacity_unavailable`, Retry-After) and the Python SDK
(RateLimitException) report; after a kill the next create is admitted. Its own service:
the session one must not be limited."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .conftest import E2EService, private_service, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]


@pytest.fixture(scope="module")
def limited() -> Iterator[E2EService]:
    with private_service("aeadm", prefix="aeadm-", pool="10.216.80.0/20",
                         extra=["--max-sandboxes", "1"]) as s:
        yield s


def test_capacity_error_then_admitted_after_a_kill(limited: E2EService,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from e2b import RateLimitException, Sandbox

    use_sdk(limited, monkeypatch)
    first = Sandbox.create(timeout=120)
    try:
        with limited.client() as c:
            r = c.post("/v2/sandboxes", json={"templateID": "base"},
                       headers={"Should-Retry": "false"})
        assert r.status_code == 429, r.text
        assert r.json()["error_code"] == "sandbox_capacity_unavailable"
        assert int(r.headers["Retry-After"]) > 0
        with pytest.raises(RateLimitException):
            Sandbox.create(timeout=120)
        assert first.commands.run("echo still").stdout == "still\n"
    finally:
        first.kill()
    second = Sandbox.create(timeout=120)
    assert second.commands.run("echo admitted").stdout == "admitted\n"
    second.kill()
    assert limited.qemu_pids() == {}
