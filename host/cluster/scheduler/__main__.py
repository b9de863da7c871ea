"""`python -m host.cluster.scheduler`: serve the scheduler (SIGTERM / SIGINT stop it)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from ..config import ConfigError, parse_scheduler
from .app import build_scheduler_app


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_scheduler(argv)
    except ConfigError as exc:
        print(f"aenv scheduler: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = cfg.address
    try:
        app = build_scheduler_app(cfg)
    except ValueError as exc:   # the node key file missing or empty
        print(f"aenv scheduler: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=host, port=port, lifespan="on",
                log_level=cfg.log_level, timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
