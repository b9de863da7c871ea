"""`python -m host.cluster.gateway`: serve the gateway (SIGTERM / SIGINT stop it)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from ..config import ConfigError, parse_gateway
from .app import build_gateway

KEEP_ALIVE_S = 75  # as the nodes: SDK pools reuse connections past uvicorn's 5 s


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_gateway(argv)
    except ConfigError as exc:
        print(f"aenv gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = cfg.address
    try:
        app = build_gateway(cfg)
    except ValueError as exc:   # a key file missing or empty, or the node key a client's
        print(f"aenv gateway: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=host, port=port, lifespan="on",
                log_level=cfg.log_level, timeout_keep_alive=KEEP_ALIVE_S,
                timeout_graceful_shutdown=10,
                ssl_certfile=str(cfg.tls_cert) if cfg.tls_cert else None,
                ssl_keyfile=str(cfg.tls_key) if cfg.tls_key else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
