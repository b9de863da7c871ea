"""What the node's runtime reports to the host's metrics at each scrape: the VMM processes
of its running VMs (their memory is read from /proc by host.metrics), and storage usage:
the block server's chunk cache and repository bytes (asked over its control socket), the
memory-snapshot cache (`memory/`) and this process's repository bytes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from host.metrics import CacheUsage, StorageUsage, Transfer
from host.storage.errors import StorageError

from .parts import NodeParts

log = logging.getLogger(__name__)

_BLOCK_STATS_S = 2.0  # a scrape does not wait longer for a busy block server


def vm_pids(parts: NodeParts) -> list[int]:
    """The pids of the running VMs' VMM processes."""
    return [sb.vm.pid for sb in parts.sandboxes.values() if sb.vm.pid is not None]


def _transfer(repo: Any) -> Transfer | None:
    moved = getattr(repo, "transferred", None)
    if moved is None:
        return None
    return Transfer(backend=repo.backend, upload_bytes=moved.upload_bytes,
                    download_bytes=moved.download_bytes)


async def storage_usage(parts: NodeParts) -> StorageUsage:
    """Caches and repository transfers of this node (the block server's part is left out
    when it does not answer: it is restarting, or predates the `stats` request)."""
    caches: list[CacheUsage] = []
    transfers: list[Transfer] = []
    try:
        block = await asyncio.wait_for(parts.block.client.stats(), _BLOCK_STATS_S)
    except (StorageError, OSError, TimeoutError) as exc:
        log.debug("metrics: the block server's stats are unavailable: %s", exc)
        block = {}
    if block.get("cache"):
        caches.append(CacheUsage(name="chunks", **block["cache"]))
    if block.get("repository"):
        transfers.append(Transfer(**block["repository"]))
    memory = parts.memory
    caches.append(CacheUsage(name="memory", used_bytes=await asyncio.to_thread(memory.used_bytes),
                             capacity_bytes=memory.bound_mib << 20, hits=memory.hits,
                             misses=memory.misses))
    own = _transfer(parts.manifests.repo)  # memory files and manifests go through it
    if own is not None:
        transfers.append(own)
    return StorageUsage(caches=tuple(caches), transfers=tuple(transfers))
