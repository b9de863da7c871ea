"""A stand-in host service for test_service_restart: opens a NodeRuntime on the given
state/run dirs, starts one sandbox from a snapshot, prints its Placement facts as one JSON
line and sleeps until it is SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from host.orchestrator.model import NetworkConfig
from host.runtime import NodeRuntime, RuntimeConfig


async def main(state_dir: str, run_dir: str, network: str, sid: str, snapshot_id: str) -> None:
    rt = await NodeRuntime(RuntimeConfig(state_dir=Path(state_dir), run_dir=Path(run_dir),
                                         network=network, vms_survive_service=True)).open()
    m = await rt.manifests.get(snapshot_id)
    from host.contract import MachineSpec, SnapshotRef
    ref = SnapshotRef(snapshot_id, MachineSpec(**m["machine"]), time.time(), None, m)
    p = await rt.start(sid, ref, NetworkConfig())
    print(json.dumps({"envd_host": p.envd_host, "envd_port": p.envd_port, "facts": p.facts}),
          flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:6]))
