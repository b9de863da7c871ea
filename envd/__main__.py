"""`envd` entry point: serve the app with uvicorn (without its idle tick: server.py)."""

from __future__ import annotations

import logging
import sys

from .app import build_app
from .config import EnvdConfig
from .server import serve


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["volume-mount"]:   # one volume's FUSE process (envd/volumes/mount.py)
        from .volumes.mount import main as mount_main
        return mount_main(args[1:])
    config = EnvdConfig.from_args(argv)
    # envd's own loggers (envd.rpc, envd.process): errors the RPC layer mapped to INTERNAL.
    logging.basicConfig(level=logging.WARNING,
                        format="envd %(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(
        build_app(config),
        host=config.host,
        port=config.port,
        log_level="warning",
        # Streams blocked on a quiet process must not hold shutdown forever.
        timeout_graceful_shutdown=5,
        # Keep idle connections long: SDK pools reuse them across RPCs.
        timeout_keep_alive=300,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
