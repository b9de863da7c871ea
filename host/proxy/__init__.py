"""The sandbox reverse proxy: routes `<port>-<id>.<domain>` (or E2b-Sandbox-* headers) to
the sandbox's address from the orchestrator, streaming HTTP and WebSockets."""

from .app import BLOCKED_ENVD_PATHS, ProxyApp, build_proxy_app
from .routing import BadTarget, Target, parse_target

__all__ = ["BLOCKED_ENVD_PATHS", "BadTarget", "ProxyApp", "Target", "build_proxy_app",
           "parse_target"]
