"""POST /aenv/reclaim: the guest drops its clean page cache before the host snapshots it.

Ours alone (E2B's envd has no such route; the host goes on without it when the answer is
404). A fork or pause copies every guest page that differs from the snapshot's base: a
guest that just wrote 200 MiB keeps them as page cache, which every child of a fork then
restores (issue 30: a fork after real setup was 4x an idle one). Dropping clean cache
(`drop_caches` 1: page cache only, not dentries or inodes) frees those pages; the guest
reports them through the balloon's free-page reporting and the host discards them, so
they stay out of the snapshot. The guest re-reads a file from its disk when it needs it.
Dirty pages are never dropped (the kernel writes them back first or keeps them), so
nothing written is lost.

Answers `{"freedMiB": N, "freeMiB": M}`: what the drop freed and what is free after it
(MemFree, /proc/meminfo). Token-protected like /envs and /metrics.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import json_error

DROP_CACHES = "/proc/sys/vm/drop_caches"
MEMINFO = "/proc/meminfo"


def free_kib(meminfo: str = MEMINFO) -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemFree:"):
                return int(line.split()[1])
    raise OSError(f"no MemFree in {meminfo}")


def drop_clean_cache(drop_caches: str = DROP_CACHES, meminfo: str = MEMINFO) -> dict[str, int]:
    before = free_kib(meminfo)
    with open(drop_caches, "w") as f:
        f.write("1\n")
    after = free_kib(meminfo)
    return {"freedMiB": max(0, after - before) // 1024, "freeMiB": after // 1024}


async def reclaim_endpoint(request: Request) -> Response:
    try:
        return JSONResponse(await asyncio.to_thread(drop_clean_cache))
    except OSError as exc:  # not root, no procfs: the host snapshots without it
        return json_error(500, f"cannot drop the page cache: {exc}")
