"""A hand-written JSON schema of the Firecracker API requests our driver may send.

Written from the facts in Firecracker's published OpenAPI document
(src/firecracker/swagger/firecracker.yaml, read at commit 81b38b9d, Aug 2026): endpoint
paths, methods, required and optional fields, types and enums. Only the endpoints the
driver could use are described. Every object forbids extra fields
(additionalProperties: false) because Firecracker parses these bodies with
`deny_unknown_fields` and answers 400 to an unknown key.

`ENDPOINTS` maps (method, path regex) to the body schema, None for requests with no body.
"""

from __future__ import annotations

import re
from typing import Any

Schema = dict[str, Any]


def _obj(required: list[str], **props: Schema) -> Schema:
    return {"type": "object", "required": required, "properties": props,
            "additionalProperties": False}


_STR: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_INT: Schema = {"type": "integer"}

_TOKEN_BUCKET = _obj(["size", "refill_time"], size={"type": "integer", "minimum": 0},
                     one_time_burst={"type": "integer", "minimum": 0},
                     refill_time={"type": "integer", "minimum": 0})
_RATE_LIMITER = _obj([], bandwidth=_TOKEN_BUCKET, ops=_TOKEN_BUCKET)

MACHINE_CONFIG = _obj(
    ["vcpu_count", "mem_size_mib"],
    vcpu_count={"type": "integer", "minimum": 1, "maximum": 32},
    mem_size_mib=_INT,
    smt=_BOOL,
    track_dirty_pages=_BOOL,
    cpu_template={"enum": ["C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"]},
    huge_pages={"enum": ["None", "Transparent", "2M"]},
)

BOOT_SOURCE = _obj(["kernel_image_path"], kernel_image_path=_STR, boot_args=_STR,
                   initrd_path=_STR)

DRIVE = _obj(
    ["drive_id", "is_root_device"],
    drive_id=_STR,
    partuuid=_STR,
    is_root_device=_BOOL,
    cache_type={"enum": ["Unsafe", "Writeback"]},
    is_read_only=_BOOL,  # virtio-block: required in practice, with path_on_host
    path_on_host=_STR,
    rate_limiter=_RATE_LIMITER,
    io_engine={"enum": ["Sync", "Async"]},
    socket=_STR,  # vhost-user-block instead of path_on_host
)

PARTIAL_DRIVE = _obj(["drive_id"], drive_id=_STR, path_on_host=_STR,
                     rate_limiter=_RATE_LIMITER)

NETWORK_INTERFACE = _obj(
    ["iface_id", "host_dev_name"],
    iface_id=_STR,
    host_dev_name=_STR,
    guest_mac=_STR,
    mtu={"type": "integer", "minimum": 68, "maximum": 65535},
    rx_rate_limiter=_RATE_LIMITER,
    tx_rate_limiter=_RATE_LIMITER,
)

BALLOON = _obj(["amount_mib", "deflate_on_oom"], amount_mib=_INT, deflate_on_oom=_BOOL,
               stats_polling_interval_s=_INT, free_page_hinting=_BOOL,
               free_page_reporting=_BOOL)
BALLOON_UPDATE = _obj(["amount_mib"], amount_mib=_INT)
BALLOON_STATS_UPDATE = _obj(["stats_polling_interval_s"], stats_polling_interval_s=_INT)

ACTION = _obj(["action_type"],
              action_type={"enum": ["FlushMetrics", "InstanceStart", "SendCtrlAltDel"]})

VM_STATE = _obj(["state"], state={"enum": ["Paused", "Resumed"]})

SNAPSHOT_CREATE = _obj(["snapshot_path", "mem_file_path"], snapshot_path=_STR,
                       mem_file_path=_STR, snapshot_type={"enum": ["Full", "Diff"]})

_MEM_BACKEND = _obj(["backend_type", "backend_path"],
                    backend_type={"enum": ["File", "Uffd"]}, backend_path=_STR)

SNAPSHOT_LOAD: Schema = {
    **_obj(
        ["snapshot_path"],
        snapshot_path=_STR,
        mem_backend=_MEM_BACKEND,
        mem_file_path=_STR,  # deprecated alternative to mem_backend
        enable_diff_snapshots=_BOOL,  # deprecated name of track_dirty_pages
        track_dirty_pages=_BOOL,
        resume_vm=_BOOL,
        network_overrides={"type": "array",
                           "items": _obj(["iface_id", "host_dev_name"], iface_id=_STR,
                                         host_dev_name=_STR)},
        vsock_override=_obj(["uds_path"], uds_path=_STR),
        clock_realtime=_BOOL,
        huge_pages={"enum": ["Snapshot", "None", "Transparent", "2M"]},
    ),
    # Exactly one of the two ways of naming guest memory.
    "oneOf": [{"required": ["mem_backend"]}, {"required": ["mem_file_path"]}],
}

_ID = r"([^/]+)"

ENDPOINTS: dict[tuple[str, str], Schema | None] = {
    ("GET", r"/"): None,
    ("GET", r"/version"): None,
    ("GET", r"/machine-config"): None,
    ("PUT", r"/machine-config"): MACHINE_CONFIG,
    ("PATCH", r"/machine-config"): {**MACHINE_CONFIG, "required": []},
    ("PUT", r"/boot-source"): BOOT_SOURCE,
    ("PUT", rf"/drives/{_ID}"): DRIVE,
    ("PATCH", rf"/drives/{_ID}"): PARTIAL_DRIVE,
    ("PUT", rf"/network-interfaces/{_ID}"): NETWORK_INTERFACE,
    ("GET", r"/balloon"): None,
    ("PUT", r"/balloon"): BALLOON,
    ("PATCH", r"/balloon"): BALLOON_UPDATE,
    ("GET", r"/balloon/statistics"): None,
    ("PATCH", r"/balloon/statistics"): BALLOON_STATS_UPDATE,
    ("PUT", r"/actions"): ACTION,
    ("PATCH", r"/vm"): VM_STATE,
    ("PUT", r"/snapshot/create"): SNAPSHOT_CREATE,
    ("PUT", r"/snapshot/load"): SNAPSHOT_LOAD,
    ("GET", r"/vm/config"): None,
}

# Path parameter -> the body field that must repeat it.
PATH_ID_FIELDS = {"drives": "drive_id", "network-interfaces": "iface_id"}


def match(method: str, path: str) -> tuple[str, Schema | None, str | None] | None:
    """(path pattern, body schema, path id) for a known endpoint, else None."""
    for (m, pattern), schema in ENDPOINTS.items():
        if m == method and (hit := re.fullmatch(pattern, path)):
            return pattern, schema, hit.group(1) if hit.groups() else None
    return None
