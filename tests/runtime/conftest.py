"""One NodeRuntime and ONE template per test session (cold boots take ~1 min under TCG);
every test restores from it. State lives under a session temp dir; `shutdown()` at the end
kills every VM, network and the block server."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from host.contract import MachineSpec, SnapshotRef
from host.runtime import NodeRuntime, RuntimeConfig
from tests.images.conftest import auth_registry, images, registry  # noqa: F401 - fixtures
from tests.vmassets import require_vm_assets

# test_image_builds.py pushes images into real registries (tests/images/conftest.py)

MEM_MB = 256


def _need_vm() -> None:
    require_vm_assets()


@pytest.fixture(scope="session")
def runtime_config(tmp_path_factory: pytest.TempPathFactory) -> RuntimeConfig:
    _need_vm()
    root = tmp_path_factory.mktemp("rt")
    # run_dir short: unix socket paths are limited to 107 bytes
    run = Path(f"/tmp/aenv-rt-{os.getpid()}")
    return RuntimeConfig(state_dir=root / "state", run_dir=run, vms_survive_service=False,
                         network=os.environ.get("AENV_TEST_NETWORK", "auto"))


@pytest.fixture(scope="session")
async def runtime(runtime_config: RuntimeConfig) -> AsyncIterator[NodeRuntime]:
    rt = await NodeRuntime(runtime_config).open()
    try:
        yield rt
    finally:
        await rt.shutdown()
        shutil.rmtree(runtime_config.run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
async def template(runtime: NodeRuntime) -> SnapshotRef:
    ref = await runtime.build_template("tpl", MachineSpec(cpu_count=1, memory_mb=MEM_MB))
    print(f"\ntemplate built: {runtime.last_timings}")
    return ref
