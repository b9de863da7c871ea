"""What a request into a sandbox carries: the client's headers, less what is ours.

Credentials never reach a guest unless a guest service there uses them:

    X-API-Key                 dropped: the REST API's key, never needed by a sandbox
    e2b-traffic-access-token  dropped: the proxy checked it (app.py), nothing after it does
    X-Access-Token            passed to envd (49983: it checks it) and to the code
                              interpreter (49999: our server, like E2B's, sends the
                              caller's token on to envd's GET /envs for the sandbox's
                              variables); dropped on every other port
    Authorization, Cookie     passed: the user's own, for the user's service (envd reads
                              the Basic user)

The envd token is the sandbox's own (envd inside it checks it), so passing it to 49999
gives away nothing the guest does not hold; what matters is that a service any user
process may listen with on another port never sees it.

Forwarding headers are ours to set: the client's Forwarded / X-Forwarded-* are dropped,
X-Forwarded-For is the proxy's peer and X-Forwarded-Proto the scheme it was reached by
(as uvicorn gives them: behind the cluster gateway, the gateway's, unless the node's
FORWARDED_ALLOW_IPS names the gateway; host/httpheaders.py); X-Forwarded-Host is set
only with network.maskRequestHost (app.py), where the Host the guest sees is not the
client's.
"""

from __future__ import annotations

from starlette.types import Scope

from host.httpheaders import (
    ACCESS_TOKEN,
    API_KEY,
    FORWARDING,
    HOP_BY_HOP,
    TRAFFIC_TOKEN,
    Headers,
    forwarding,
    without,
)

from .routing import CODE_INTERPRETER_PORT, ENVD_PORT

# the ports whose servers use the caller's envd token (see above)
ACCESS_TOKEN_PORTS = frozenset({ENVD_PORT, CODE_INTERPRETER_PORT})

_NEVER = HOP_BY_HOP | FORWARDING | {API_KEY, TRAFFIC_TOKEN}
_NOT_TOKEN_PORT = _NEVER | {ACCESS_TOKEN}


def guest_headers(scope: Scope, port: int, *, drop: frozenset[bytes] = frozenset()) -> Headers:
    """The client's headers as sandbox port `port` gets them (also less `drop`, e.g. what
    a WebSocket client makes for its own handshake), X-Forwarded-For/-Proto this hop's."""
    names = (_NEVER if port in ACCESS_TOKEN_PORTS else _NOT_TOKEN_PORT) | drop
    return forwarding(without(scope["headers"], names), scope)
