"""A QEMU VM's virtio-balloon over QMP (the device: cmdline.py; discards over a shared
base: preload.py).

QMP speaks of the guest's size, not the balloon's: `balloon value=` is the RAM the guest
is to keep and `query-balloon` answers what it keeps now. The guest's memory report comes
through the device's QOM properties once a polling interval is set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..driver import BalloonStats
from ..errors import VmmError
from .cmdline import BALLOON_ID

Qmp = Callable[[str, dict[str, Any] | None], Awaitable[Any]]

PATH = f"/machine/peripheral/{BALLOON_ID}"
# how often the guest reports its memory; the first report comes one interval after
POLL_S = 2
_MIB = 1 << 20


async def set_size(qmp: Qmp, name: str, mem_mib: int, amount_mib: int) -> None:
    if not 0 <= amount_mib < mem_mib:
        raise VmmError(f"{name}: a balloon of {amount_mib} MiB does not fit {mem_mib} MiB "
                       "of guest RAM")
    await qmp("balloon", {"value": (mem_mib - amount_mib) * _MIB})


async def stats(qmp: Qmp, mem_mib: int, target_mib: int) -> BalloonStats:
    actual = int((await qmp("query-balloon", None))["actual"]) // _MIB
    # idempotent, and cheap enough to send with every read: a restored VM gets its
    # polling back without a hook in every start path
    await qmp("qom-set", {"path": PATH, "property": "guest-stats-polling-interval",
                          "value": POLL_S})
    got = await qmp("qom-get", {"path": PATH, "property": "guest-stats"})
    reported = got.get("last-update", 0) > 0
    raw: dict[str, int] = got.get("stats", {}) if reported else {}

    def mib(key: str) -> int | None:
        v = raw.get(key, -1)  # -1: the guest did not report this one
        return None if v < 0 else v // _MIB

    return BalloonStats(size_mib=max(0, mem_mib - actual), target_mib=target_mib,
                        available_mib=mib("stat-available-memory"),
                        free_mib=mib("stat-free-memory"), caches_mib=mib("stat-disk-caches"))
