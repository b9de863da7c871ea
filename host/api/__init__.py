"""The E2B-compatible REST API: `build_api_app(orchestrator, keys)` and API-key handling."""

from .app import build_api_app
from .auth import ApiKeys

__all__ = ["ApiKeys", "build_api_app"]
