"""Target resolution (spec §1.6.1): by Host `<port>-<id>.<domain>`, or by E2b-Sandbox-*
headers when the host is localhost, an IP literal or `sandbox.<domain>`."""

from __future__ import annotations

import pytest

from host.proxy.routing import BadTarget, Target, host_name, parse_target

D = "sbx.example.com"


@pytest.mark.parametrize("raw,name", [
    ("49983-abc.sbx.example.com", "49983-abc.sbx.example.com"),
    ("49983-ABC.Sbx.Example.com:443", "49983-abc.sbx.example.com"),
    ("localhost:3001", "localhost"),
    ("[::1]:3001", "::1"),
    ("127.0.0.1", "127.0.0.1"),
])
def test_host_name(raw: str, name: str) -> None:
    assert host_name(raw) == name


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1", "10.1.2.3", f"sandbox.{D}"])
def test_header_hosts(host: str) -> None:
    assert parse_target(host, "abc123", "8080", D) == Target("abc123", 8080)
    with pytest.raises(BadTarget, match="missing header E2b-Sandbox-Id"):
        parse_target(host, None, "8080", D)
    with pytest.raises(BadTarget, match="missing header E2b-Sandbox-Port"):
        parse_target(host, "abc123", None, D)


def test_host_label_routing_ignores_headers() -> None:
    assert parse_target(f"49983-abc123.{D}", "other", "1", D) == Target("abc123", 49983)
    # legacy `<port>-<id>-<clientID>` hosts: the id is the second part (as upstream)
    assert parse_target(f"3000-abc123-6532622b.{D}", None, None, D) == Target("abc123", 3000)
    # without a configured domain, any dotted host is parsed
    assert parse_target("80-x1.anything.tld", None, None, None) == Target("x1", 80)


@pytest.mark.parametrize("host,msg", [
    ("nodots", "Invalid host"),
    (f"abc.{D}", "Invalid host"),
    (f"http-abc.{D}", "invalid sandbox port"),
    (f"0-abc.{D}", "invalid sandbox port"),
    (f"70000-abc.{D}", "invalid sandbox port"),
    (f"80-.{D}", "invalid sandbox id"),
    (f"80-a_b.{D}", "invalid sandbox id"),
])
def test_bad_hosts(host: str, msg: str) -> None:
    with pytest.raises(BadTarget, match=msg):
        parse_target(host, None, None, D)
