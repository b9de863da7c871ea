"""The built-in template: our Debian image, cold-booted and snapshotted once envd answers
(a template build with no steps; see builds.py)."""

from __future__ import annotations

from host.contract import BuildSpec, MachineSpec, SnapshotRef

from . import builds
from .parts import NodeParts


async def build_template(p: NodeParts, template_id: str, machine: MachineSpec) -> SnapshotRef:
    return await builds.build(p, BuildSpec(snapshot_id=template_id, machine=machine))
