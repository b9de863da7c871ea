"""HTTP header rules the sandbox proxy (host/proxy) and the cluster gateway
(host/cluster/gateway) share: which headers never cross a hop, which are our own
credentials, which forwarding headers only we may set, and reading a header of an ASGI
scope. Header names are lower-case bytes, as ASGI servers give them.

Who removes what on the way into a sandbox (client -> [gateway ->] node proxy -> guest):

    X-API-Key                 the gateway (a client key) and the node proxy (traffic needs none)
    e2b-traffic-access-token  the node proxy, after checking it (the gateway passes it on:
                              only the node knows the sandbox's token)
    X-Access-Token            the node proxy, except to the ports that use it
                              (host/proxy/forwarding.py)
    Forwarded, X-Forwarded-*  every hop: what a client sent is dropped; X-Forwarded-For and
                              -Proto set to the hop's peer and scheme (`forwarding`)

The peer and scheme are those uvicorn gives the app: the TCP peer's, except that uvicorn
believes the X-Forwarded-For / -Proto of a peer in its `forwarded_allow_ips`
(FORWARDED_ALLOW_IPS; by default loopback only: a TLS terminator on the same host). A
node can so be told to believe the cluster gateway in front of it; a client cannot.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Scope

Headers = list[tuple[bytes, bytes]]

# Hop-by-hop headers (RFC 9110 §7.6.1) plus those the server side already handled
# (Expect: uvicorn answered the 100-continue; the body is re-framed on the next hop).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection",
                        b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"expect"})

# What the WebSocket client library of the next hop makes itself for its own handshake.
WS_HANDSHAKE = frozenset({b"host", b"upgrade", b"connection", b"sec-websocket-key",
                          b"sec-websocket-version", b"sec-websocket-extensions",
                          b"sec-websocket-protocol", b"content-length"})

API_KEY = b"x-api-key"                        # the REST API's key (spec §2.1)
TRAFFIC_TOKEN = b"e2b-traffic-access-token"   # a sandbox's user ports (spec §2.5)
ACCESS_TOKEN = b"x-access-token"              # envd's token (spec §2.2)

# Forwarding headers: a client's own copies are dropped (they would be believed
# downstream), each hop sets X-Forwarded-For and -Proto again.
FORWARDED_FOR = b"x-forwarded-for"
FORWARDED_HOST = b"x-forwarded-host"
FORWARDED_PROTO = b"x-forwarded-proto"
FORWARDING = frozenset({b"forwarded", FORWARDED_FOR, FORWARDED_HOST, FORWARDED_PROTO,
                        b"x-forwarded-port", b"x-real-ip"})
_PROTO = {"ws": b"http", "wss": b"https"}


def header(scope: Scope, name: bytes) -> str | None:
    """The first `name` header of an ASGI scope, decoded as latin-1; None when absent."""
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


def without(headers: Iterable[tuple[bytes, bytes]], names: frozenset[bytes]) -> Headers:
    """`headers` less those named (lower-case names, as ASGI gives them)."""
    return [(k, v) for k, v in headers if k not in names]


def forwarding(headers: Headers, scope: Scope) -> Headers:
    """`headers` (already without FORWARDING) with X-Forwarded-For set to this hop's peer
    and X-Forwarded-Proto to its scheme: set, not appended to, since a client's own would
    be taken for the truth."""
    client = scope.get("client")
    if client:
        headers.append((FORWARDED_FOR, str(client[0]).encode("latin-1")))
    scheme = str(scope.get("scheme", "http"))
    headers.append((FORWARDED_PROTO, _PROTO.get(scheme) or scheme.encode("latin-1")))
    return headers
