"""envd: the guest agent. Serves the E2B envd protocol (Connect RPC + HTTP) on :49983."""

__version__ = "0.6.13"  # the upstream envd protocol version whose semantics we implement

__all__ = ["__version__"]
