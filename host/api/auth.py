"""API keys and the node key: generated on first start, kept in 0600 files, checked on
every request in constant time.

A key file holds one key per line (blank lines and `#` comments ignored). Clients send a
key as `X-API-Key` (any case; the SDKs spell it `X-API-KEY`). Only `GET /health` is open,
`GET /metrics` (Prometheus scrapes without a key; host/metrics), the PUT of a COPY
archive to its signed URL (uploads.py), which the signature authorises, and the volume
content routes, which the volume's own token authorises (volumes.py; as E2B's, the SDKs
send no API key there).

In a cluster the services talk to each other with the *node key*, a secret of its own
(`NodeKeys`, `<state>/node_key` on a node), never a client's API key:

    route                 an API key    the node key
    /cluster/...          403           yes   (adopt, forget, signer, peers' files)
    anything else         yes           yes   (the gateway forwards its clients' calls
                                               with the node key, once it checked theirs)

A service that holds no node key (a standalone node, the gateway's own API) refuses
/cluster/... to everyone; one that holds no API keys (the scheduler) takes the node key only.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from host.private import create_private

from .errors import error_response

DEFAULT_KEYS_PATH = Path("/var/lib/aenv/api_keys")
KEY_PREFIX = "e2b_"
NODE_KEY_PREFIX = "aenv_node_"
OPEN_PATHS = frozenset({"/health", "/metrics"})
SIGNED_PREFIX = "/template-files/"  # PUT only: the URL's signature is checked instead
VOLUME_CONTENT_PREFIX = "/volumecontent/"  # the volume's Bearer token instead (api/volumes.py)
CLUSTER_PREFIX = "/cluster/"         # routes only the cluster's own services call


def is_open(method: str, path: str) -> bool:
    """Requests that need no API key."""
    return (path in OPEN_PATHS or (method == "PUT" and path.startswith(SIGNED_PREFIX))
            or path.startswith(VOLUME_CONTENT_PREFIX))


def is_cluster_route(path: str) -> bool:
    """Routes that take the node key only."""
    return path.startswith(CLUSTER_PREFIX)


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)


def new_node_key() -> str:
    return NODE_KEY_PREFIX + secrets.token_urlsafe(32)


def _read_keys(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


class _KeySet:
    """Keys compared in constant time; the first is the one a client of them sends."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys if k)
        if not self._keys:
            raise ValueError(f"{type(self).__name__} needs at least one key")

    @property
    def first(self) -> str:
        return self._keys[0].decode()

    def accepts(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        ok = False
        for k in self._keys:  # no early exit: timing does not reveal which key matched
            ok |= hmac.compare_digest(given, k)
        return ok

    def shares_a_key_with(self, other: _KeySet) -> bool:
        """Whether any key is in both sets (a node key that is also a client's key)."""
        return any(other.accepts(k.decode()) for k in self._keys)


class ApiKeys(_KeySet):
    """The API keys clients may use."""

    @classmethod
    def load_or_create(cls, path: Path | str = DEFAULT_KEYS_PATH) -> ApiKeys:
        """Read the key file; on first start create it (mode 0600) with one new key."""
        path = Path(path)
        if not path.exists():
            create_private(path, (new_key() + "\n").encode())
        keys = _read_keys(path)
        if not keys:
            raise ValueError(f"no API keys in {path}")
        return cls(keys)


class NodeKeys(_KeySet):
    """The cluster's node key: what the gateway and the scheduler send to nodes, and nodes
    to each other (--p2p). Every machine of a cluster holds the same file. Each line is
    accepted and the first is sent, so a new key is rolled out as a second line everywhere,
    then moved first, then the old line is removed."""

    @classmethod
    def load(cls, path: Path | str) -> NodeKeys:
        """Read the node key file (the gateway's and the scheduler's: it must exist, a new
        key there would be one no node accepts)."""
        path = Path(path)
        try:
            keys = _read_keys(path)
        except FileNotFoundError:
            raise ValueError(f"no node key file {path}: copy the cluster's node key there "
                             "(a node makes <state>/node_key on its first start)") from None
        if not keys:
            raise ValueError(f"no node key in {path}")
        return cls(keys)

    @classmethod
    def load_or_create(cls, path: Path | str) -> NodeKeys:
        """A node's node key file, created (0600, one new key) on its first start."""
        path = Path(path)
        if not path.exists():
            create_private(path, (new_node_key() + "\n").encode())
        return cls.load(path)


def check_separate(keys: ApiKeys, node_keys: NodeKeys) -> None:
    """Raise ValueError when a key is both a client's and the node key: that client could
    call the /cluster/ routes."""
    if keys.shares_a_key_with(node_keys):
        raise ValueError("a key of the node key file is also an API key: the node key must "
                         "be a secret of its own (make a new one; see host/cluster/README.md)")


class ApiKeyMiddleware:
    """Pure ASGI: rejects HTTP requests without a valid key for their route (module
    docstring) with an E2B error body: 401 without a valid key, 403 for an API key on a
    /cluster/ route. `keys` None: API keys are not accepted (the scheduler)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys | None,
                 node_keys: NodeKeys | None = None) -> None:
        if keys is None and node_keys is None:
            raise ValueError("ApiKeyMiddleware needs API keys, a node key or both")
        self.app = app
        self.keys = keys
        self.node_keys = node_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        key = None
        for name, value in scope["headers"]:
            if name == b"x-api-key":  # ASGI servers lower-case header names
                key = value.decode("latin-1")
                break
        # both sets are always compared: which one matched does not show in the timing
        node_ok = self.node_keys is not None and self.node_keys.accepts(key)
        client_ok = self.keys is not None and self.keys.accepts(key)
        if is_cluster_route(scope["path"]):
            if node_ok:
                await self.app(scope, receive, send)
            elif client_ok:
                await error_response(403, "this route is for the cluster's services: it "
                                          "takes the node key, not an API key")(
                    scope, receive, send)
            else:
                await error_response(401, _refusal(key))(scope, receive, send)
            return
        if not (node_ok or client_ok):
            await error_response(401, _refusal(key))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _refusal(key: str | None) -> str:
    return "missing X-API-Key header" if key is None else "invalid API key"
