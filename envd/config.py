"""Start-up configuration of envd, parsed once and passed down explicitly."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

DEFAULT_PORT = 49983


@dataclass(frozen=True)
class EnvdConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    # Upstream envd's compiled-in default user is root; the host's POST /init
    # overrides it (our templates set "user").
    default_user: str = "root"
    default_workdir: str | None = None
    # Keepalive interval used when a stream does not send Keepalive-Ping-Interval.
    default_keepalive_s: float = 90.0
    # Largest Connect message accepted (SendInput / StreamInput chunks).
    read_max_bytes: int = 64 * 1024 * 1024

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> EnvdConfig:
        p = argparse.ArgumentParser(prog="envd", description="E2B-compatible guest agent")
        p.add_argument("--host", default=os.environ.get("ENVD_HOST", cls.host))
        p.add_argument("--port", type=int, default=int(os.environ.get("ENVD_PORT", cls.port)))
        p.add_argument("--default-user", default=os.environ.get("ENVD_DEFAULT_USER", cls.default_user))
        p.add_argument("--default-workdir", default=os.environ.get("ENVD_DEFAULT_WORKDIR"))
        a = p.parse_args(argv)
        return cls(host=a.host, port=a.port, default_user=a.default_user,
                   default_workdir=a.default_workdir)
