"""GET /metrics: guest resource usage for the host's sandbox metrics (psutil)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psutil  # type: ignore[import-untyped]
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

MIB = 1024 * 1024

# cpu_percent(interval=None) measures since its previous call; prime it so the first
# /metrics answer covers the time since envd started instead of reading 0.0.
psutil.cpu_percent(interval=None)


def sample(disk_path: str = "/") -> dict[str, Any]:
    """One metrics sample; CPU % is measured since the previous sample (0.0 on the first)."""
    vm = psutil.virtual_memory()
    disk = psutil.disk_usage(disk_path)
    return {
        "ts": int(time.time()),
        "cpu_count": psutil.cpu_count() or 1,
        "cpu_used_pct": round(psutil.cpu_percent(interval=None), 2),
        "mem_total": vm.total,
        "mem_used": vm.used,
        "mem_cache": getattr(vm, "cached", 0),
        "mem_total_mib": vm.total // MIB,
        "mem_used_mib": vm.used // MIB,
        "disk_used": disk.used,
        "disk_total": disk.total,
    }


async def metrics(request: Request) -> Response:
    return JSONResponse(await asyncio.to_thread(sample))
