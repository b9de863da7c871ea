"""The E2B-compatible REST API: `build_api_app(orchestrator, keys)` and the handling of API
keys and of the cluster's node key.

The wire models (`host.api.models`) import without the app: the CLI parses the API's
answers with them, so `build_api_app`, `ApiKeys` and `NodeKeys` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import build_api_app
    from .auth import ApiKeys, NodeKeys

__all__ = ["ApiKeys", "NodeKeys", "build_api_app"]


def __getattr__(name: str) -> Any:
    if name == "build_api_app":
        from .app import build_api_app
        return build_api_app
    if name == "ApiKeys":
        from .auth import ApiKeys
        return ApiKeys
    if name == "NodeKeys":
        from .auth import NodeKeys
        return NodeKeys
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
