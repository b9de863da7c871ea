"""Configuration of the gateway and the scheduler, parsed once from the environment and the
command line (flags win), in the style of host/config.py.

Gateway (`python -m host.cluster.gateway`):

    AENV_CLUSTER_REDIS    --redis         redis://127.0.0.1:6379/0   the cluster store
    AENV_GATEWAY_LISTEN   --listen        127.0.0.1:8080   REST API and sandbox traffic
    AENV_SCHEDULER_URL    --scheduler     http://127.0.0.1:9090
    AENV_GATEWAY_KEYS     --keys          /var/lib/aenv/api_keys   keys clients may use
    AENV_NODE_KEY_FILE    --node-key-file /var/lib/aenv/node_key   the cluster's node key,
                                          sent to the nodes and the scheduler (a secret of
                                          its own: none of --keys; host/api/auth.py)
    AENV_NODE_TLS_CA      --node-tls-ca   -    PEM CA bundle that https:// node addresses are
                                          verified with (default: the system's CAs)
    AENV_DOMAIN           --domain        -    returned as `domain` in Sandbox answers
                                          (default: as the node answered)

Scheduler (`python -m host.cluster.scheduler`):

    AENV_CLUSTER_REDIS        --redis        redis://127.0.0.1:6379/0
    AENV_SCHEDULER_LISTEN     --listen       127.0.0.1:9090
    AENV_SCHEDULER_STRATEGY   --strategy     least-loaded | round-robin
    AENV_SCHEDULER_SANDBOX_MIB --sandbox-mib 256   memory a new sandbox is assumed to need
    AENV_NODE_KEY_FILE        --node-key-file -    require the cluster's node key
                                                   (X-API-Key), which the gateway sends
    AENV_SCHEDULER_SWEEP_S    --sweep        1.0   how often dead nodes are looked for
    AENV_CLUSTER_RETENTION_S  --retention    86400 how long dead nodes and lost sandboxes
                                                   stay visible
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from host.config import redact

from .placement import Strategy

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value is invalid."""


def split_listen(listen: str, default_port: int) -> tuple[str, int]:
    """`HOST[:PORT]` (IPv6 in brackets) -> (host, port)."""
    host, port = listen, default_port
    if listen.startswith("["):
        end = listen.find("]")
        host, rest = listen[1:end], listen[end + 1:]
        if rest.startswith(":"):
            port = int(rest[1:])
    elif listen.count(":") == 1:
        host, raw = listen.split(":")
        port = int(raw)
    if not 0 < port < 65536:
        raise ConfigError(f"listen port must be a TCP port, got {port}")
    return host or "127.0.0.1", port


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    redis: str = DEFAULT_REDIS
    listen: str = "127.0.0.1:8080"
    scheduler: str = "http://127.0.0.1:9090"
    keys: Path = Path("/var/lib/aenv/api_keys")
    node_key_file: Path = Path("/var/lib/aenv/node_key")
    node_tls_ca: Path | None = None   # verifies https:// nodes (else the system's CAs)
    domain: str | None = None
    log_level: str = "info"
    tls_cert: Path | None = None   # PEM chain: serve HTTPS (with tls_key)
    tls_key: Path | None = None

    @property
    def address(self) -> tuple[str, int]:
        return split_listen(self.listen, 8080)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    redis: str = DEFAULT_REDIS
    listen: str = "127.0.0.1:9090"
    strategy: Strategy = Strategy.LEAST_LOADED
    sandbox_mib: int = 256
    node_key_file: Path | None = None   # None: no key required (keep the port private)
    sweep_s: float = 1.0
    retention_s: float = 86400.0
    log_level: str = "info"

    @property
    def address(self) -> tuple[str, int]:
        return split_listen(self.listen, 9090)


_GATEWAY_ENV = {"redis": "AENV_CLUSTER_REDIS", "listen": "AENV_GATEWAY_LISTEN",
                "scheduler": "AENV_SCHEDULER_URL", "keys": "AENV_GATEWAY_KEYS",
                "node_key_file": "AENV_NODE_KEY_FILE", "node_tls_ca": "AENV_NODE_TLS_CA",
                "domain": "AENV_DOMAIN", "log_level": "AENV_LOG_LEVEL",
                "tls_cert": "AENV_GATEWAY_TLS_CERT", "tls_key": "AENV_GATEWAY_TLS_KEY"}
_SCHEDULER_ENV = {"redis": "AENV_CLUSTER_REDIS", "listen": "AENV_SCHEDULER_LISTEN",
                  "strategy": "AENV_SCHEDULER_STRATEGY",
                  "sandbox_mib": "AENV_SCHEDULER_SANDBOX_MIB",
                  "node_key_file": "AENV_NODE_KEY_FILE",
                  "sweep_s": "AENV_SCHEDULER_SWEEP_S", "retention_s": "AENV_CLUSTER_RETENTION_S",
                  "log_level": "AENV_LOG_LEVEL"}
_TYPES: dict[str, Any] = {"keys": Path, "node_key_file": Path, "node_tls_ca": Path,
                          "tls_cert": Path, "tls_key": Path, "sandbox_mib": int,
                          "sweep_s": float, "retention_s": float, "strategy": Strategy}


def _parse(cls: type[C], env_names: Mapping[str, str], args: argparse.Namespace,
           env: Mapping[str, str]) -> C:
    values: dict[str, Any] = {}
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for name, var in env_names.items():
        raw = env.get(var)
        if raw:
            try:
                values[name] = _TYPES.get(name, str)(raw)
            except ValueError as exc:
                raise ConfigError(f"{var}: {exc}") from None
    values.update({k: v for k, v in vars(args).items() if v is not None and k in names})
    try:
        values = {k: _TYPES[k](v) if k in _TYPES else v for k, v in values.items()}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cls(**values)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", help=f"the cluster store (default {DEFAULT_REDIS})")
    p.add_argument("--listen", help="HOST[:PORT] to serve on")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def _check_redis(url: str) -> None:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"--redis must be a redis://, rediss:// or unix:// URL, got "
                          f"{redact(url)!r}")


def parse_gateway(argv: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m host.cluster.gateway",
                                description="aenv cluster gateway: the one endpoint of a "
                                            "cluster (REST API and sandbox traffic)")
    _common(p)
    p.add_argument("--scheduler", help="the scheduler's URL")
    p.add_argument("--keys", type=Path, help="API key file (one key a line)")
    p.add_argument("--node-key-file", type=Path,
                   help="the cluster's node key file, sent to the nodes and the scheduler")
    p.add_argument("--node-tls-ca", type=Path,
                   help="PEM CA bundle to verify https:// nodes with")
    p.add_argument("--domain", help="returned as `domain` in Sandbox answers")
    p.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate chain")
    p.add_argument("--tls-key", help="the certificate's PEM private key")
    cfg = _parse(GatewayConfig, _GATEWAY_ENV, p.parse_args(argv),
                 os.environ if env is None else env)
    _check_redis(cfg.redis)
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    for path in (cfg.tls_cert, cfg.tls_key, cfg.node_tls_ca):
        if path is not None and not path.is_file():
            raise ConfigError(f"TLS file {path} does not exist")
    cfg.address  # noqa: B018 - validates listen
    if urlsplit(cfg.scheduler).scheme not in ("http", "https"):
        raise ConfigError(f"--scheduler must be an http(s) URL, got {cfg.scheduler!r}")
    return cfg


def parse_scheduler(argv: Sequence[str] | None = None,
                    env: Mapping[str, str] | None = None) -> SchedulerConfig:
    p = argparse.ArgumentParser(prog="python -m host.cluster.scheduler",
                                description="aenv cluster scheduler: places sandboxes on "
                                            "nodes, declares dead nodes")
    _common(p)
    p.add_argument("--strategy", choices=[s.value for s in Strategy])
    p.add_argument("--sandbox-mib", type=int, help="memory a new sandbox is assumed to need")
    p.add_argument("--node-key-file", type=Path,
                   help="require the cluster's node key (the gateway sends it)")
    p.add_argument("--sweep", type=float, dest="sweep_s", help="seconds between sweeps")
    p.add_argument("--retention", type=float, dest="retention_s",
                   help="seconds dead nodes and lost sandboxes stay visible")
    cfg = _parse(SchedulerConfig, _SCHEDULER_ENV, p.parse_args(argv),
                 os.environ if env is None else env)
    _check_redis(cfg.redis)
    cfg.address  # noqa: B018 - validates listen
    if cfg.sandbox_mib < 1 or cfg.sweep_s <= 0 or cfg.retention_s <= 0:
        raise ConfigError("sandbox_mib >= 1, sweep_s > 0 and retention_s > 0")
    return cfg
