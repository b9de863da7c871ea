"""Observability of the host service: Prometheus metrics (one registry per service
instance, `Metrics`) and structured logs (`setup_logging`, the sandbox a record concerns).

A leaf package: it imports nothing from the rest of `host`, so every layer may take a
`Metrics` at construction; what it reads at scrape time it is handed as callables.
README.md maps its modules and lists every metric.
"""

from .asgi import METRICS_PATH, ExchangeMetrics, ProxyMetrics, metrics_route
from .collectors import CacheUsage, StorageUsage, Transfer, pss_bytes
from .instruments import OPERATIONS, Metrics, ServiceMetrics
from .logs import (
    LOG_FORMATS,
    JsonFormatter,
    SandboxIdFilter,
    bind_sandbox,
    current_sandbox,
    sandbox_context,
    setup_logging,
)

__all__ = ["LOG_FORMATS", "METRICS_PATH", "OPERATIONS", "CacheUsage", "ExchangeMetrics",
           "JsonFormatter", "Metrics", "ProxyMetrics", "SandboxIdFilter", "ServiceMetrics",
           "StorageUsage", "Transfer", "bind_sandbox", "current_sandbox", "metrics_route",
           "pss_bytes", "sandbox_context", "setup_logging"]
