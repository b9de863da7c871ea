"""The node runtime: `NodeRuntime` implements `host.orchestrator.runtime.SandboxRuntime`
by composing the QEMU argv builder and memory snapshots (host/vmm), the block server
(host/storage) and network namespaces (host/network).

    rt = await NodeRuntime(RuntimeConfig(state_dir=Path("/var/lib/aenv"),
                                         run_dir=Path("/run/aenv/rt"))).open()
    tpl = await rt.build_template("base", MachineSpec(memory_mb=512))
    placement = await rt.start("sbx1", tpl, NetworkConfig())
    paused = await rt.snapshot("sbx1", "snap1", stop=True)
"""

from .config import RuntimeConfig
from .errors import (
    NodeRuntimeError,
    SandboxNotFoundError,
    SandboxStartError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
)
from .node import NodeRuntime

__all__ = [
    "NodeRuntime",
    "NodeRuntimeError",
    "RuntimeConfig",
    "SandboxNotFoundError",
    "SandboxStartError",
    "SnapshotCorruptError",
    "SnapshotNotFoundError",
]
