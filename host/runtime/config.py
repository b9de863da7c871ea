"""Configuration of one node's runtime (parsed once by the host service, passed down)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from host.vmm.jail import JailConfig


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Where the runtime keeps things and how it runs VMs.

    - `state_dir`: durable node state: `memory/<snapshot id>/` (frozen bases, memory diffs),
      `storage/` (the block server's layers, uppers and stack manifests), `layers.json`
      (image digest -> LSMT layer digest cache), `blockserver.log`.
    - `run_dir`: volatile: `storage/{nbd,control}.sock`, `vms/<sandbox id>/` (QMP socket,
      serial log, QEMU stderr). Keep it short: unix socket paths are limited to 107 bytes.
    - `repository`: the block server's layer repository and where snapshots (manifests
      and memory files) are committed (`posix_fs:/path` or `oss://...`).
    - `cache_dir`/`cache_mib`: the chunk cache of remote layers; `memory_cache_mib`: the
      bound of `memory/` when the repository is remote (least recently used snapshots
      no live sandbox needs are evicted; they are fetched again when used).
    - `network`: "auto" (namespaces when host/network can make them, else user-mode
      networking), "netns" or "user". Every snapshot records its mode; a node restores only
      snapshots of its own mode (the guest's network config is part of its memory).
    - `vms_survive_service`: False makes every QEMU die with the process that started it
      (tests); True lets VMs outlive a host-service restart so `adopt()` can find them.
    """

    state_dir: Path = Path("/var/lib/aenv")
    run_dir: Path = Path("/run/aenv/rt")
    repository: str | None = None  # default: posix_fs:<state_dir>/repo
    cache_dir: Path | None = None  # chunk cache for remote (oss) layers; default <state>/cache
    cache_mib: int = 10240
    memory_cache_mib: int = 10240  # bound of memory/ with a remote repository (LRU of snapshots)
    image_cache: Path | None = None  # $AENV_CACHE (make kernel image outputs)
    network: str = "auto"
    network_prefix: str = "aenv-"
    network_pool: str = "10.200.0.0/16"
    registry_mirror: str | None = None  # serves docker.io names (e.g. http://127.0.0.1:5000)
    insecure_registries: tuple[str, ...] = ()  # plain HTTP allowed (loopback always is)
    vmm: str = "auto"  # auto | qemu | firecracker (auto: $AENV_VMM, else what the host runs)
    qemu: str = "qemu-system-x86_64"
    firecracker: str = "firecracker"
    jailer: str = "auto"  # auto (on PATH, as root) | off | a path
    jailer_uid: int = 0
    jailer_gid: int = 0
    vms_survive_service: bool = True
    ksm: bool = False  # ksmd merges VMs' identical pages (host.hostmem.KsmSwitch)
    tcg_tb_mib: int | None = None  # under TCG, each VM's code buffer (None: QEMU driver's)
    balloon: bool = True  # a virtio-balloon in every VM (host/vmm VmSpec.balloon)
    # every VMM confined (host/vmm/jail); JailConfig(enabled=False) runs them as root
    jail: JailConfig = field(default_factory=JailConfig)
    p2p: bool = False  # the block server reads layers from neighbours first (peers_file)
    max_chain: int = 8  # memory diff chain length before a pause writes a cumulative diff
    # the children of a fork share one memory image (forkimages.py) when each would copy
    # at least this much of the parent's diff into its RAM (0: never)
    fork_share_min_mib: int = 64
    # a sandbox's own disk layers before they are merged into one (compaction.py; 0: never)
    max_disk_chain: int = 8
    # template builds from an OCI image restore their VM from the node's builder instead
    # of cold-booting it (builder.py; QEMU only)
    builders: bool = True
    envd_timeout_s: float = 60.0  # restore -> envd /health
    boot_timeout_s: float = 240.0  # cold boot (template build) -> envd /health
    block_server_python: str | None = None  # default: sys.executable
    # a layer or memory dir younger than this is never collected: a snapshot's files are
    # written before its manifest names them (runtime/collect.py)
    collect_min_age_s: float = 600.0
    # build-step and OCI-import cache entries unused this long are dropped (collect.py)
    build_cache_ttl_s: float = 7 * 86400.0
    # this node in a repository others share (holds.py: its holdings' name), and how
    # long another node's holdings count once it stopped rewriting them
    node_id: str = field(default_factory=socket.gethostname)
    node_expiry_s: float = 3600.0
    node_clock_skew_s: float = 60.0  # how far nodes' wall clocks may differ (holds.py)

    @property
    def repository_spec(self) -> str:
        return self.repository or f"posix_fs:{self.state_dir / 'repo'}"

    @property
    def owns_repository(self) -> bool:
        """Whether this node alone uses its repository (the default one under its state
        dir, however it was named), so a collection may delete the repository's copies
        too. Another one may be shared: another node's stacks can read a layer no
        document names any more."""
        return self.repository_spec == f"posix_fs:{self.state_dir / 'repo'}"

    @property
    def chunk_cache_dir(self) -> Path:
        return self.cache_dir or self.state_dir / "cache"

    @property
    def layers_dir(self) -> Path:
        """The block server's sealed layers (this node's own)."""
        return self.state_dir / "storage" / "layers"

    @property
    def peers_file(self) -> Path:
        """Neighbours and the layers they hold (`--p2p`: host/cluster/peers.py writes it,
        the block server reads it: host/storage/peers.py)."""
        return self.state_dir / "peers.json"

    @property
    def memory_dir(self) -> Path:
        return self.state_dir / "memory"

    @property
    def oci_cache_dir(self) -> Path:
        """Pulled OCI images: blobs shared by all images, one layout per manifest."""
        return self.state_dir / "oci"

    @property
    def vms_dir(self) -> Path:
        return self.run_dir / "vms"

    @property
    def vm_logs_dir(self) -> Path:
        """`<sandbox id>/serial.log` of each QEMU VM: on disk (the run dir is often tmpfs)."""
        return self.state_dir / "vmlogs"

    @property
    def storage_run_dir(self) -> Path:
        return self.run_dir / "storage"
