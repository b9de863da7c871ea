"""`python3 -m aenv_code_interpreter`: serve the code interpreter with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .app import build_app
from .settings import Settings


def main() -> int:
    settings = Settings.from_env()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="code-interpreter %(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        # one process: contexts and their kernels live in this process's memory
        workers=1,
        # executions can stream for a long time; keep idle SDK connections around too
        timeout_keep_alive=640,
        # a stream blocked on a busy kernel must not hold shutdown forever
        timeout_graceful_shutdown=2,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
