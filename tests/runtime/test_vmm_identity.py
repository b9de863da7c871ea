"""Memory snapshots are keyed on the VMM that took them (issue 14 item 20), no VM
(fakenode.py): each records the driver's identity (VMM version, accelerator, -cpu), a
restore under another one is refused before anything is fetched or made, naming both
versions and the reboot resume, which still works; snapshots without the record restore."""

from __future__ import annotations

from pathlib import Path

import pytest

from host.contract import NetworkConfig, SnapshotIncompatible
from host.runtime import starts
from host.runtime.errors import SnapshotIncompatibleError
from host.runtime.snapshots import snapshot
from host.vmm.identity import VmmIdentity

from .fakenode import GatedDriver, fake_node, publish_template, ref

pytestmark = pytest.mark.asyncio(loop_scope="session")

NET = NetworkConfig()
QEMU_7 = VmmIdentity(vmm="qemu", version="QEMU emulator version 7.2.19", accel="tcg",
                     cpu="max")
QEMU_8 = VmmIdentity(vmm="qemu", version="QEMU emulator version 8.2.2", accel="tcg",
                     cpu="max")
KVM_HOST = VmmIdentity(vmm="qemu", version="QEMU emulator version 7.2.19", accel="kvm",
                       cpu="host", host_cpu="AMD EPYC 7B13")


def _repo(tmp: Path) -> str:
    return f"posix_fs:{tmp / 'repo'}"


async def test_restore_under_another_vmm_version_is_refused(tmp_path: Path) -> None:
    m = await publish_template(tmp_path, _repo(tmp_path), "tpl", mib=1, vmm=QEMU_7.to_json())
    driver = GatedDriver(identity=QEMU_8)  # the node's QEMU was upgraded
    p = fake_node(tmp_path / "node", _repo(tmp_path), driver)
    m["kind"] = "snapshot"  # a pause: the hint is the reboot resume
    await p.manifests.put("tpl", m)
    with pytest.raises(SnapshotIncompatibleError) as err:
        await starts.start(p, "sbx", ref(m), NET, reboot=False)
    msg = str(err.value)
    assert "QEMU emulator version 7.2.19" in msg and "QEMU emulator version 8.2.2" in msg
    assert 'on_resume="reboot"' in msg and "memory=false" in msg
    assert isinstance(err.value, SnapshotIncompatible)  # what the orchestrator maps (409)
    # refused before anything was fetched, provisioned or started
    assert not (p.memory.dir / "tpl").exists() and not p.block.client.stacks
    assert driver.calls == [] and not p.sandboxes and not p.memory.pins
    # its disk still boots
    await starts.start(p, "sbx", ref(m), NET, reboot=True)
    assert ("start", "sbx") in driver.calls


async def test_another_cpu_model_or_accelerator_is_refused(tmp_path: Path) -> None:
    m = await publish_template(tmp_path, _repo(tmp_path), "tpl", mib=1,
                               vmm=KVM_HOST.to_json())
    p = fake_node(tmp_path / "node", _repo(tmp_path), GatedDriver(identity=QEMU_7))
    with pytest.raises(SnapshotIncompatibleError) as err:
        await starts.start(p, "sbx", ref(m), NET, reboot=False)
    msg = str(err.value)
    assert "accel 'kvm' here is 'tcg'" in msg and "cpu 'host' here is 'max'" in msg
    assert "-cpu host" in msg and "-cpu max" in msg and "rebuild the template" in msg
    # the same accelerator and -cpu on another host CPU model
    other = VmmIdentity(**{**KVM_HOST.to_json(), "host_cpu": "Intel Xeon Gold 6348"})
    p2 = fake_node(tmp_path / "node2", _repo(tmp_path), GatedDriver(identity=other))
    with pytest.raises(SnapshotIncompatibleError, match="AMD EPYC 7B13.*Intel Xeon"):
        await starts.start(p2, "sbx", ref(m), NET, reboot=False)


async def test_snapshots_without_the_record_still_restore(tmp_path: Path) -> None:
    m = await publish_template(tmp_path, _repo(tmp_path), "tpl", mib=1)  # no "vmm"
    p = fake_node(tmp_path / "node", _repo(tmp_path), GatedDriver(identity=QEMU_8))
    await starts.start(p, "sbx", ref(m), NET, reboot=False)
    # a record with only some fields: the missing ones are unknown, accepted
    partial = {**m, "vmm": {"vmm": "qemu", "accel": "tcg"}}
    await p.manifests.put("tpl2", {**partial, "snapshot_id": "tpl2"})
    await starts.start(p, "sbx2", ref({**partial, "snapshot_id": "tpl2"}), NET, reboot=False)
    assert set(p.sandboxes) == {"sbx", "sbx2"}


async def test_a_pause_records_the_identity_and_an_upgrade_refuses_it(tmp_path: Path) -> None:
    m = await publish_template(tmp_path, _repo(tmp_path), "tpl", mib=1)
    driver = GatedDriver(identity=QEMU_7)
    p = fake_node(tmp_path / "node", _repo(tmp_path), driver)
    await starts.start(p, "sbx", ref(m), NET, reboot=False)
    paused = await snapshot(p, "sbx", "sbx-p1", stop=True, memory=True)
    assert paused.facts["vmm"] == QEMU_7.to_json()
    assert (await p.manifests.get("sbx-p1"))["vmm"] == QEMU_7.to_json()
    # a filesystem-only pause holds no memory, hence no identity
    await starts.start(p, "sbx", paused, NET, reboot=False)
    disk = await snapshot(p, "sbx", "sbx-p2", stop=True, memory=False)
    assert "vmm" not in disk.facts
    # the node's QEMU is upgraded: the memory pause is refused, naming both versions
    driver.vmm_identity = QEMU_8
    with pytest.raises(SnapshotIncompatibleError, match=r"7\.2\.19.*8\.2\.2"):
        await starts.start(p, "sbx", paused, NET, reboot=False)
    await starts.start(p, "sbx", paused, NET, reboot=True)  # the reboot resume works
    # a cold-booted sandbox's next pause freezes a new base under the new identity
    again = await snapshot(p, "sbx", "sbx-p3", stop=True, memory=True)
    assert again.facts["vmm"] == QEMU_8.to_json()


async def test_a_config_digest_mismatch_is_incompatible_too(tmp_path: Path) -> None:
    m = await publish_template(tmp_path, _repo(tmp_path), "tpl", mib=1)
    m["config_sha256"] = "another-vmm-configuration"
    p = fake_node(tmp_path / "node", _repo(tmp_path), GatedDriver())
    await p.manifests.put("tpl", m)
    with pytest.raises(SnapshotIncompatibleError, match="another VMM configuration"):
        await starts.start(p, "sbx", ref(m), NET, reboot=False)
    assert not p.block.client.stacks and not p.sandboxes
