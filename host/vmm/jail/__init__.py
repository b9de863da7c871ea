"""The VMM jail: every VMM process in its own cgroup, mount namespace, root, network
namespace and uid, with no capabilities and `no_new_privs` (see jail.py and README.md)."""

from __future__ import annotations

from .cgroup import Cgroup, CgroupError, Limits, detect_version
from .config import DEFAULT_UID_RANGE, JailConfig, UidPool, UidRangeError, parse_uid_range
from .jail import Bind, Jail, forget

__all__ = ["DEFAULT_UID_RANGE", "Bind", "Cgroup", "CgroupError", "Jail", "JailConfig",
           "Limits", "UidPool", "UidRangeError", "detect_version", "forget", "parse_uid_range"]
