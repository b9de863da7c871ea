"""API keys: generated on first start into a 0600 file, reloaded after, compared exactly;
the cluster's node key: its own file, the only key of the /cluster/ routes."""

from __future__ import annotations

import asyncio
import stat

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from host.api.auth import ApiKeyMiddleware, ApiKeys, NodeKeys, check_separate


def test_first_start_creates_a_private_key_file(tmp_path) -> None:
    path = tmp_path / "state" / "api_keys"
    keys = ApiKeys.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert key.startswith("e2b_") and len(key) > 30 and keys.first == key
    assert ApiKeys.load_or_create(path).first == key      # stable across restarts
    assert keys.accepts(key) and not keys.accepts(key + "x") and not keys.accepts(None)


def test_several_keys_and_comments(tmp_path) -> None:
    path = tmp_path / "api_keys"
    path.write_text("# operators\nkey-one\n\n  key-two  \n")
    keys = ApiKeys.load_or_create(path)
    assert keys.accepts("key-one") and keys.accepts("key-two") and not keys.accepts("# operators")


def test_empty_key_file_is_an_error(tmp_path) -> None:
    path = tmp_path / "api_keys"
    path.write_text("# nothing\n")
    with pytest.raises(ValueError):
        ApiKeys.load_or_create(path)


# --- the node key (host/api/auth.py's table) --------------------------------------------

NODE_KEY = "aenv_node_k"


def test_node_key_file_is_made_private_and_kept(tmp_path) -> None:
    path = tmp_path / "state" / "node_key"
    with pytest.raises(ValueError, match="no node key file"):
        NodeKeys.load(path)            # the gateway's and scheduler's: never invented
    keys = NodeKeys.load_or_create(path)   # a node's: made on its first start
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert key.startswith("aenv_node_") and len(key) > 40 and keys.first == key
    assert NodeKeys.load(path).first == key and NodeKeys.load_or_create(path).first == key


def test_node_key_rotation_accepts_every_line_and_sends_the_first(tmp_path) -> None:
    path = tmp_path / "node_key"
    path.write_text("# rolled out 2025-01\naenv_node_new\naenv_node_old\n")
    keys = NodeKeys.load(path)
    assert keys.first == "aenv_node_new"
    assert keys.accepts("aenv_node_old") and not keys.accepts("aenv_node_other")
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no node key"):
        NodeKeys.load(path)


def test_a_node_key_that_is_also_an_api_key_is_refused() -> None:
    check_separate(ApiKeys(["e2b_a"]), NodeKeys([NODE_KEY]))
    with pytest.raises(ValueError, match="also an API key"):
        check_separate(ApiKeys(["e2b_a", NODE_KEY]), NodeKeys(["aenv_node_x", NODE_KEY]))


async def _ok(request: Request) -> Response:
    return PlainTextResponse("ok")


def _app(keys: ApiKeys | None, node_keys: NodeKeys | None) -> Starlette:
    routes = [Route(p, _ok, methods=["GET", "POST"])
              for p in ("/health", "/v2/sandboxes", "/cluster/signer", "/cluster/memory/x")]
    return Starlette(routes=routes, middleware=[
        Middleware(ApiKeyMiddleware, keys=keys, node_keys=node_keys)])


def _status(app: Starlette, path: str, key: str | None) -> int:
    async def go() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://node") as c:
            headers = {"X-API-Key": key} if key is not None else {}
            return (await c.get(path, headers=headers)).status_code
    return asyncio.run(go())


@pytest.mark.parametrize(("path", "key", "status"), [
    ("/v2/sandboxes", "e2b_a", 200),           # a client
    ("/v2/sandboxes", NODE_KEY, 200),          # the gateway forwarding a client's call
    ("/v2/sandboxes", "wrong", 401),
    ("/cluster/signer", NODE_KEY, 200),        # the gateway's own calls
    ("/cluster/memory/x", NODE_KEY, 200),      # a neighbour (--p2p)
    ("/cluster/signer", "e2b_a", 403),         # a client key never opens a cluster route
    ("/cluster/memory/x", "e2b_a", 403),
    ("/cluster/signer", None, 401),
    ("/cluster/signer", "wrong", 401),
    ("/health", None, 200),
])
def test_node_in_a_cluster(path: str, key: str | None, status: int) -> None:
    assert _status(_app(ApiKeys(["e2b_a"]), NodeKeys([NODE_KEY])), path, key) == status


def test_standalone_node_and_scheduler() -> None:
    standalone = _app(ApiKeys(["e2b_a"]), None)     # no node key: no cluster route opens
    assert _status(standalone, "/cluster/signer", "e2b_a") == 403
    assert _status(standalone, "/cluster/signer", NODE_KEY) == 401
    assert _status(standalone, "/v2/sandboxes", NODE_KEY) == 401
    scheduler = _app(None, NodeKeys([NODE_KEY]))      # the node key only
    assert _status(scheduler, "/v2/sandboxes", NODE_KEY) == 200
    assert _status(scheduler, "/v2/sandboxes", "e2b_a") == 401
    with pytest.raises(ValueError):
        ApiKeyMiddleware(_ok, None, None)  # type: ignore[arg-type]
