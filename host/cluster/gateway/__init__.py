"""The cluster gateway: the one endpoint clients use, forwarding the REST API and sandbox
traffic to the node holding each sandbox (see README.md)."""

from .app import Gateway, build_gateway, classify

__all__ = ["Gateway", "build_gateway", "classify"]
