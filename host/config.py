"""Configuration of the host service, parsed once from the environment and the command line
(flags win) and passed down explicitly.

    AENV_STATE_DIR   --state-dir    /var/lib/aenv     SQLite state, API keys, snapshots
    AENV_RUN_DIR     --run-dir      /run/aenv/rt      sockets, per-VM work dirs (keep short)
    AENV_LISTEN      --listen       127.0.0.1         address of both listeners
    AENV_API_PORT    --api-port     3000              REST API
    AENV_PROXY_PORT  --proxy-port   3001              sandbox proxy (envd and user ports)
    AENV_DOMAIN      --domain       sbx.localhost     returned as `domain` to the SDKs
    AENV_PROXY_URL   --proxy-url    <scheme>://<listen>:<proxy port>   the proxy's public URL
                                                      (links to the web terminal)
    AENV_REPOSITORY  --repository   posix_fs:<state>/repo   or oss://...
    AENV_CACHE_DIR   --cache-dir    <state>/cache     local cache of remote (oss) layer chunks
    AENV_CACHE_MIB   --cache-mib    10240             its bound, and that of the local copies
                                                      of remote memory snapshots (<state>/memory)
    AENV_TLS         --tls          off               serve both listeners over HTTPS (a local
                                                      CA's certificate for *.<domain>, made in
                                                      <state>/tls)
    AENV_TLS_CERT / AENV_TLS_KEY  --tls-cert / --tls-key   serve HTTPS with this PEM chain
                                                      and key instead (implies --tls): in a
                                                      cluster, one naming the advertised host
                                                      and signed by the gateway's --node-tls-ca
    AENV_VMM         --vmm          auto              auto | qemu | firecracker (auto: Firecracker
                                                      where its binary and KVM work and it passed
                                                      scripts/check-kvm.sh on this host, else
                                                      QEMU; host/vmm/verified.py)
    AENV_FIRECRACKER --firecracker  firecracker       the Firecracker binary (name on PATH or path)
    AENV_JAILER      --jailer       auto              auto (jailer on PATH, as root) | off | path
    AENV_JAILER_UID / AENV_JAILER_GID  (0 / 0)        uid:gid a jailed Firecracker runs as
    AENV_VM_JAIL     --vm-jail / --no-vm-jail  on     confine every VMM process (host/vmm/jail):
                                                      its own uid, no capabilities, no_new_privs,
                                                      seccomp, a private mount namespace and
                                                      root, a cgroup with the sandbox's limits
    AENV_VM_UID_RANGE --vm-uid-range 1879048192-1879113727   the uids (and gids) VMMs run as,
                                                      one per VM; a block nothing else uses
    AENV_VM_OVERHEAD_MIB --vm-overhead-mib 256        a VMM's memory on top of guest RAM in its
                                                      cgroup's limit
    AENV_TCG_TB_MIB  --tcg-tb-mib   64                under TCG (no usable KVM), the translated
                                                      code each VM keeps before QEMU flushes it
                                                      (0: QEMU's 1 GiB). It is host memory that
                                                      only grows: 30 sandboxes that ran a 300 MiB
                                                      python hog held 3331 MiB after it at 64,
                                                      2518 at 32, whose hog ran ~25 % slower
                                                      (bench/bench_balloon.py)
    AENV_NETWORK     --network      auto              auto | netns | user (user-mode networking,
                                                      where netns is unavailable: guests get no
                                                      outbound network, only their envd port)
    AENV_NETWORK_PREFIX / AENV_NETWORK_POOL   namespace/veth name prefix (aenv-) and the
                     guest address pool (10.200.0.0/16): distinct per service on one host
    AENV_ENVD_TIMEOUT_S --envd-timeout 180            restore -> envd /health (generous: TCG under load)
    AENV_IMAGE, AENV_CPU_COUNT, AENV_MEMORY_MB, AENV_DISK_MB   the default template's machine
    AENV_MAX_STARTS  --max-starts   4                 VM starts (creates, forks, resumes) at once;
                                                      more wait their turn
    AENV_GC_INTERVAL_S --gc-interval 600            seconds between runs of the node's collector
                                                      (killed sandboxes' records, unreachable
                                                      snapshots, layers and memory files; 0: only
                                                      `aenv gc`)
    AENV_GC_MIN_AGE_S --gc-min-age 600              a layer or memory file younger than this is never
                                                      collected (its snapshot may still be writing)
    AENV_RETAIN_KILLED --retain-killed 86400          seconds a killed sandbox's record and events
                                                      are kept
    AENV_BUILD_CACHE_TTL --build-cache-ttl 604800     seconds a build-step or image-import cache
                                                      entry, or an uploaded COPY archive, is kept
                                                      after its last use
    AENV_MIN_FREE_DISK_MIB --min-free-disk-mib 2048   below this much free disk in the state dir,
                                                      starts are refused (507) and /health is 503
    AENV_MAX_SANDBOXES --max-sandboxes 0              sandboxes holding a VM on this node (0: no
                                                      fixed limit); beyond it a start is refused
                                                      with E2B's capacity error (429)
    AENV_MEMORY_RESERVE_MIB --memory-reserve-mib 1024 a start is refused (429) rather than leave
                                                      the host less MemAvailable than this
    AENV_MEMORY_PRESSURE_MIB --memory-pressure-mib 768 below this much available memory (host
                                                      or memory cgroup) the coldest running
                                                      sandboxes are paused until twice it is
                                                      available (0: never)
    AENV_WARM_POOL   --warm-pool    1                 VMs of the template creates came from last
                                                      kept restored (stopped) for the next creates
                                                      (0: none)
    AENV_KEEP_PAUSED --keep-paused  30                seconds a paused sandbox's VM stays
                                                      (stopped) after its pause committed: a
                                                      resume meanwhile continues it (given back
                                                      first under memory pressure; 0: never)
    AENV_DRAIN_ON_STOP --drain-on-stop / --no-drain-on-stop off   at SIGTERM, pause every
                                                      running sandbox with its memory before
                                                      exiting; the next start resumes them (for
                                                      deploys whose VMs die with the service:
                                                      containers; systemd's outlive it)
    AENV_KSM         --ksm / --no-ksm off            start ksmd and let it merge the VMs'
                                                      identical pages (more sandboxes per GiB;
                                                      off: merged pages are a side channel
                                                      between the guests sharing them)
    AENV_VM_BALLOON  --vm-balloon / --no-vm-balloon on  a virtio-balloon in every VM: guests
                                                      return the memory they free (free-page
                                                      reporting) and idle ones their page
                                                      cache under memory pressure (templates
                                                      made with the other setting are rebuilt)
    AENV_BUILDERS    --builders / --no-builders on  template builds from an OCI image restore
                                                      their VM from the node's builder (made
                                                      once per machine shape) instead of
                                                      cold-booting it; its envd lives in a
                                                      tmpfs, ~70 MiB of each such sandbox's
                                                      RAM its kernel cannot reclaim
    AENV_CLUSTER_REDIS --cluster-redis -              redis://... : join a cluster (host/cluster):
                                                      heartbeat capacity and sandboxes into it
    AENV_NODE_ID     --node-id      <host name>       this node's id in the cluster
    AENV_NODE_KEY_FILE --node-key-file <state>/node_key   the cluster's node key (made
                                                      on first start; the same file on
                                                      every machine): the gateway, the
                                                      scheduler and neighbours send it,
                                                      never an API key (host/api/auth.py)
    AENV_ADVERTISE_URL --advertise-url http://<listen>:<api port>   the API as the gateway
                                                      reaches it (set it when listening on 0.0.0.0)
    AENV_ADVERTISE_PROXY_URL --advertise-proxy-url <advertise host>:<proxy port>
    AENV_HEARTBEAT_S --heartbeat-interval 2.0         seconds between heartbeats; the node is
    AENV_HEARTBEAT_MISSES --heartbeat-misses 3        dead after this many missed (6 s)
    AENV_P2P         --p2p / --no-p2p off             in a cluster: read snapshots' memory
                                                      files and layers from neighbours before
                                                      the (oss) repository, and serve this
                                                      node's to them (host/cluster/peers.py)
    AENV_TEMPLATE_UPLOAD_MIB --template-upload-mib 2048   largest COPY archive a template
                                                      build may upload (MiB)
    AENV_REGISTRY_MIRROR --registry-mirror -          serves docker.io image names for builds
    AENV_INSECURE_REGISTRIES --insecure-registry       registries reached over plain HTTP
                     (comma list / repeatable; loopback registries always are)
    AENV_LOG_LEVEL   --log-level    info              debug | info | warning | error
    AENV_LOG_FORMAT  --log-format   text              text | json (one object a line, with
                                                      sandbox_id; host/metrics/logs.py)
    AENV_METRICS     --metrics / --no-metrics  on     GET /metrics on the API listener
                                                      (Prometheus, no API key: host/metrics)
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from host.vmm.jail.config import DEFAULT_UID_RANGE, JailConfig, parse_uid_range
from host.vmm.qemu.cmdline import TCG_TB_MIB

VMM_DRIVERS = ("auto", "qemu", "firecracker")
NETWORK_MODES = ("auto", "netns", "user")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A configuration value is invalid."""


@dataclass(frozen=True, kw_only=True)
class Config:
    state_dir: Path = Path("/var/lib/aenv")
    run_dir: Path = Path("/run/aenv/rt")
    listen: str = "127.0.0.1"
    api_port: int = 3000
    proxy_port: int = 3001
    proxy_url: str | None = None
    domain: str = "sbx.localhost"
    repository: str | None = None
    cache_dir: Path | None = None
    cache_mib: int = 10240
    tls: bool = False
    tls_cert: Path | None = None   # PEM chain served instead of the local CA's (with tls_key)
    tls_key: Path | None = None
    vmm: str = "auto"
    firecracker: str = "firecracker"
    jailer: str = "auto"
    jailer_uid: int = 0
    jailer_gid: int = 0
    network: str = "auto"
    network_prefix: str = "aenv-"
    network_pool: str = "10.200.0.0/16"
    image: str = "default"
    cpu_count: int = 1
    memory_mb: int = 512
    disk_mb: int = 2048
    default_template: str = "base"
    ttl_interval_s: float = 1.0
    envd_timeout_s: float = 180.0
    template_upload_mib: int = 2048
    max_starts: int = 4
    max_sandboxes: int = 0
    memory_reserve_mib: int = 1024
    memory_pressure_mib: int = 768
    warm_pool: int = 1
    keep_paused_s: float = 30.0
    gc_interval_s: float = 600.0
    retain_killed_s: float = 86400.0
    build_cache_ttl_s: float = 7 * 86400.0
    gc_min_age_s: float = 600.0
    min_free_disk_mib: int = 2048
    ksm: bool = False
    vm_balloon: bool = True
    builders: bool = True
    drain_on_stop: bool = False
    vm_jail: bool = True
    vm_uid_range: str = DEFAULT_UID_RANGE
    vm_overhead_mib: int = 256
    tcg_tb_mib: int = TCG_TB_MIB
    cluster_redis: str | None = None
    p2p: bool = False
    node_id: str | None = None
    node_key_file: Path | None = None
    advertise_url: str | None = None
    advertise_proxy_url: str | None = None
    heartbeat_s: float = 2.0
    heartbeat_misses: int = 3
    registry_mirror: str | None = None
    insecure_registries: tuple[str, ...] = ()
    log_level: str = "info"
    log_format: str = "text"
    metrics: bool = True

    def jail(self) -> JailConfig:
        """The VMM jail's settings (host/vmm/jail)."""
        first, count = parse_uid_range(self.vm_uid_range)
        return JailConfig(enabled=self.vm_jail, uid_range=(first, count),
                          overhead_mib=self.vm_overhead_mib)

    @property
    def db_path(self) -> Path:
        return self.state_dir / "state.db"

    @property
    def public_proxy_url(self) -> str:
        """Where clients reach the proxy (the web terminal's links point there)."""
        if self.proxy_url:
            return self.proxy_url.rstrip("/")
        host = "127.0.0.1" if self.listen in ("0.0.0.0", "::") else self.listen
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.proxy_port}"

    @property
    def keys_path(self) -> Path:
        return self.state_dir / "api_keys"

    @property
    def node_key_path(self) -> Path:
        return self.node_key_file or self.state_dir / "node_key"

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def repository_spec(self) -> str:
        return self.repository or f"posix_fs:{self.state_dir / 'repo'}"

    @property
    def volumes_dir(self) -> Path:
        """E2B volumes: in a posix_fs repository (nodes sharing it share the volumes),
        else (an oss repository) in the state dir, this node's own."""
        spec = self.repository_spec
        if spec.startswith("posix_fs:"):
            return Path(spec.removeprefix("posix_fs:")) / "volumes"
        return self.state_dir / "volumes"


def _bool(value: str, name: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be a boolean, got {value!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m host",
                                description="aenv host service: REST API + sandbox proxy")
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--listen")
    p.add_argument("--api-port", type=int)
    p.add_argument("--proxy-port", type=int)
    p.add_argument("--domain")
    p.add_argument("--proxy-url", help="the proxy's public URL (web terminal links)")
    p.add_argument("--repository", help="posix_fs:/path (default) or oss://bucket/prefix")
    p.add_argument("--cache-dir", type=Path,
                   help="local cache of repository layer chunks (default <state>/cache)")
    p.add_argument("--cache-mib", type=int, help="bound of that cache (MiB)")
    p.add_argument("--tls", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tls-cert", type=Path,
                   help="serve HTTPS with this PEM certificate chain (implies --tls)")
    p.add_argument("--tls-key", type=Path, help="the certificate's PEM private key")
    p.add_argument("--vmm", choices=VMM_DRIVERS)
    p.add_argument("--firecracker", help="the Firecracker binary (default: firecracker on PATH)")
    p.add_argument("--jailer", help="auto (jailer on PATH when root), off, or a path")
    p.add_argument("--jailer-uid", type=int)
    p.add_argument("--jailer-gid", type=int)
    p.add_argument("--network", choices=NETWORK_MODES)
    p.add_argument("--network-prefix")
    p.add_argument("--network-pool")
    p.add_argument("--image")
    p.add_argument("--cpu-count", type=int)
    p.add_argument("--memory-mb", type=int)
    p.add_argument("--disk-mb", type=int)
    p.add_argument("--envd-timeout", type=float, dest="envd_timeout_s")
    p.add_argument("--registry-mirror",
                   help="serves docker.io image names (e.g. http://127.0.0.1:5000)")
    p.add_argument("--insecure-registry", action="append", dest="insecure_registries",
                   help="a registry (host[:port]) reached over plain HTTP; repeatable "
                        "(loopback registries always are)")
    p.add_argument("--template-upload-mib", type=int,
                   help="largest COPY archive a template build may upload (MiB)")
    p.add_argument("--max-starts", type=int, help="VM starts at once (the rest wait)")
    p.add_argument("--max-sandboxes", type=int,
                   help="sandboxes holding a VM on this node (0: no fixed limit)")
    p.add_argument("--memory-reserve-mib", type=int,
                   help="refuse a start that would leave less available host memory")
    p.add_argument("--memory-pressure-mib", type=int,
                   help="pause the coldest sandboxes below this much available memory "
                        "(0: never)")
    p.add_argument("--warm-pool", type=int,
                   help="VMs kept restored for the next creates from a template (0: none)")
    p.add_argument("--keep-paused", dest="keep_paused_s", type=float,
                   help="seconds a paused sandbox's VM stays, stopped, for a fast resume "
                        "(0: never)")
    p.add_argument("--gc-interval", dest="gc_interval_s", type=float,
                   help="seconds between runs of the node's collector (0: only `aenv gc`)")
    p.add_argument("--gc-min-age", dest="gc_min_age_s", type=float,
                   help="seconds before an unused layer or memory file may be collected")
    p.add_argument("--retain-killed", dest="retain_killed_s", type=float,
                   help="seconds a killed sandbox's record and events are kept")
    p.add_argument("--build-cache-ttl", dest="build_cache_ttl_s", type=float,
                   help="seconds a build-step or image-import cache entry, or an uploaded "
                        "COPY archive, is kept after its last use")
    p.add_argument("--min-free-disk-mib", type=int,
                   help="refuse starts (507) and answer /health 503 below this much free "
                        "disk in the state dir (0: never)")
    p.add_argument("--tcg-tb-mib", type=int,
                   help="under TCG, the translated code each VM keeps (MiB; 0: QEMU's 1 GiB)")
    p.add_argument("--ksm", action=argparse.BooleanOptionalAction, default=None,
                   help="start ksmd and let it merge the VMs' identical pages")
    p.add_argument("--vm-balloon", action=argparse.BooleanOptionalAction, default=None,
                   help="a virtio-balloon in every VM (free-page reporting; inflated for "
                        "idle sandboxes under memory pressure)")
    p.add_argument("--builders", action=argparse.BooleanOptionalAction, default=None,
                   help="template builds from an image restore their VM from the node's "
                        "builder instead of cold-booting it")
    p.add_argument("--drain-on-stop", action=argparse.BooleanOptionalAction, default=None,
                   help="at SIGTERM pause every running sandbox (with memory) before "
                        "exiting; the next start resumes them")
    p.add_argument("--vm-jail", action=argparse.BooleanOptionalAction, default=None,
                   help="confine every VMM process (own uid, no capabilities, seccomp, "
                        "private mount namespace, cgroup); default on")
    p.add_argument("--vm-uid-range", help="FIRST-LAST: the uids VMMs run as, one per VM")
    p.add_argument("--vm-overhead-mib", type=int,
                   help="a VMM's memory on top of guest RAM in its cgroup's limit")
    p.add_argument("--cluster-redis", help="join the cluster whose store is this Redis URL")
    p.add_argument("--p2p", action=argparse.BooleanOptionalAction, default=None,
                   help="in a cluster: memory files from neighbours before the repository")
    p.add_argument("--node-id", help="this node's id in the cluster (default: host name)")
    p.add_argument("--node-key-file", type=Path,
                   help="the cluster's node key (default <state>/node_key, made if absent)")
    p.add_argument("--advertise-url", help="this node's API URL for the gateway")
    p.add_argument("--advertise-proxy-url", help="this node's proxy URL for the gateway")
    p.add_argument("--heartbeat-interval", type=float, dest="heartbeat_s")
    p.add_argument("--heartbeat-misses", type=int, help="missed heartbeats before dead")
    p.add_argument("--ttl-interval", type=float, dest="ttl_interval_s")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", choices=LOG_FORMATS,
                   help="text (default) or json: one object a line, with sandbox_id")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=None,
                   help="serve GET /metrics (Prometheus) on the API listener (default on)")
    return p


_ENV: dict[str, tuple[str, type]] = {
    "state_dir": ("AENV_STATE_DIR", Path), "run_dir": ("AENV_RUN_DIR", Path),
    "listen": ("AENV_LISTEN", str), "api_port": ("AENV_API_PORT", int),
    "proxy_port": ("AENV_PROXY_PORT", int), "domain": ("AENV_DOMAIN", str),
    "proxy_url": ("AENV_PROXY_URL", str),
    "repository": ("AENV_REPOSITORY", str), "tls": ("AENV_TLS", bool),
    "tls_cert": ("AENV_TLS_CERT", Path), "tls_key": ("AENV_TLS_KEY", Path),
    "cache_dir": ("AENV_CACHE_DIR", Path), "cache_mib": ("AENV_CACHE_MIB", int),
    "vmm": ("AENV_VMM", str), "network": ("AENV_NETWORK", str),
    "firecracker": ("AENV_FIRECRACKER", str), "jailer": ("AENV_JAILER", str),
    "jailer_uid": ("AENV_JAILER_UID", int), "jailer_gid": ("AENV_JAILER_GID", int),
    "network_prefix": ("AENV_NETWORK_PREFIX", str), "network_pool": ("AENV_NETWORK_POOL", str),
    "image": ("AENV_IMAGE", str),
    "cpu_count": ("AENV_CPU_COUNT", int), "memory_mb": ("AENV_MEMORY_MB", int),
    "disk_mb": ("AENV_DISK_MB", int), "ttl_interval_s": ("AENV_TTL_INTERVAL_S", float),
    "envd_timeout_s": ("AENV_ENVD_TIMEOUT_S", float),
    "template_upload_mib": ("AENV_TEMPLATE_UPLOAD_MIB", int),
    "max_starts": ("AENV_MAX_STARTS", int), "max_sandboxes": ("AENV_MAX_SANDBOXES", int),
    "memory_reserve_mib": ("AENV_MEMORY_RESERVE_MIB", int),
    "memory_pressure_mib": ("AENV_MEMORY_PRESSURE_MIB", int),
    "warm_pool": ("AENV_WARM_POOL", int), "keep_paused_s": ("AENV_KEEP_PAUSED", float),
    "gc_interval_s": ("AENV_GC_INTERVAL_S", float),
    "retain_killed_s": ("AENV_RETAIN_KILLED", float),
    "build_cache_ttl_s": ("AENV_BUILD_CACHE_TTL", float),
    "gc_min_age_s": ("AENV_GC_MIN_AGE_S", float),
    "min_free_disk_mib": ("AENV_MIN_FREE_DISK_MIB", int),
    "ksm": ("AENV_KSM", bool), "vm_jail": ("AENV_VM_JAIL", bool),
    "vm_balloon": ("AENV_VM_BALLOON", bool),
    "builders": ("AENV_BUILDERS", bool),
    "vm_uid_range": ("AENV_VM_UID_RANGE", str), "vm_overhead_mib": ("AENV_VM_OVERHEAD_MIB", int),
    "tcg_tb_mib": ("AENV_TCG_TB_MIB", int),
    "cluster_redis": ("AENV_CLUSTER_REDIS", str), "p2p": ("AENV_P2P", bool),
    "drain_on_stop": ("AENV_DRAIN_ON_STOP", bool), "node_id": ("AENV_NODE_ID", str),
    "node_key_file": ("AENV_NODE_KEY_FILE", Path),
    "advertise_url": ("AENV_ADVERTISE_URL", str),
    "advertise_proxy_url": ("AENV_ADVERTISE_PROXY_URL", str),
    "heartbeat_s": ("AENV_HEARTBEAT_S", float), "heartbeat_misses": ("AENV_HEARTBEAT_MISSES", int),
    "registry_mirror": ("AENV_REGISTRY_MIRROR", str),
    "insecure_registries": ("AENV_INSECURE_REGISTRIES", tuple),
    "log_level": ("AENV_LOG_LEVEL", str),
    "log_format": ("AENV_LOG_FORMAT", str), "metrics": ("AENV_METRICS", bool),
}


def parse_config(argv: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None) -> Config:
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field, (var, typ) in _ENV.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            if typ is tuple:  # a comma-separated list
                values[field] = tuple(x.strip() for x in raw.split(",") if x.strip())
            else:
                values[field] = _bool(raw, var) if typ is bool else typ(raw)
        except ValueError as exc:
            raise ConfigError(f"{var}: {exc}") from None
    args = _parser().parse_args(argv)
    values.update({k: (tuple(v) if isinstance(v, list) else v)
                   for k, v in vars(args).items() if v is not None})
    if values.get("tls_cert") is not None and values.get("tls") is None:
        values["tls"] = True   # a certificate given is one to serve
    cfg = Config(**values)  # type: ignore[arg-type]
    _validate(cfg)
    return cfg


def _validate(cfg: Config) -> None:
    for name in ("api_port", "proxy_port"):
        port = getattr(cfg, name)
        if not 0 < port < 65536:
            raise ConfigError(f"{name} must be a TCP port, got {port}")
    if cfg.api_port == cfg.proxy_port:
        raise ConfigError("the API and the proxy need different ports")
    if cfg.vmm not in VMM_DRIVERS:
        raise ConfigError(f"vmm must be one of {VMM_DRIVERS}, got {cfg.vmm!r}")
    if not cfg.firecracker.strip():
        raise ConfigError("firecracker must name a binary")
    if cfg.jailer_uid < 0 or cfg.jailer_gid < 0:
        raise ConfigError("jailer_uid and jailer_gid must be >= 0")
    try:
        parse_uid_range(cfg.vm_uid_range)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.vm_overhead_mib < 32:
        raise ConfigError(f"vm_overhead_mib must be at least 32, got {cfg.vm_overhead_mib}")
    if cfg.tcg_tb_mib < 0:
        raise ConfigError(f"tcg_tb_mib must be >= 0 (0: QEMU's default), got {cfg.tcg_tb_mib}")
    if cfg.log_format not in LOG_FORMATS:
        raise ConfigError(f"log_format must be one of {LOG_FORMATS}, got {cfg.log_format!r}")
    if cfg.network not in NETWORK_MODES:
        raise ConfigError(f"network must be one of {NETWORK_MODES}, got {cfg.network!r}")
    if not cfg.domain or "/" in cfg.domain or ":" in cfg.domain:
        raise ConfigError(f"domain must be a DNS name, got {cfg.domain!r}")
    _validate_tls(cfg)
    if cfg.proxy_url and urlparse(cfg.proxy_url).scheme not in ("http", "https"):
        raise ConfigError(f"proxy_url must be an http(s) URL, got {cfg.proxy_url!r}")
    if cfg.cpu_count < 1 or cfg.memory_mb < 128 or cfg.disk_mb < 0:
        raise ConfigError("cpu_count >= 1, memory_mb >= 128, disk_mb >= 0")
    if cfg.template_upload_mib < 1:
        raise ConfigError(f"template_upload_mib must be at least 1, got {cfg.template_upload_mib}")
    if cfg.max_starts < 1 or cfg.max_sandboxes < 0 or cfg.memory_reserve_mib < 0 or \
            cfg.memory_pressure_mib < 0 or cfg.warm_pool < 0 or cfg.keep_paused_s < 0:
        raise ConfigError("max_starts >= 1, max_sandboxes >= 0, memory_reserve_mib >= 0, "
                          "memory_pressure_mib >= 0, warm_pool >= 0, keep_paused >= 0")
    if cfg.gc_interval_s < 0 or cfg.retain_killed_s < 0 or cfg.min_free_disk_mib < 0 or \
            cfg.gc_min_age_s < 0 or cfg.build_cache_ttl_s < 0:
        raise ConfigError("gc_interval >= 0, retain_killed >= 0, min_free_disk_mib >= 0, "
                          "gc_min_age >= 0, build_cache_ttl >= 0")
    _validate_cluster(cfg)
    if cfg.cache_mib < 64:
        raise ConfigError(f"cache_mib must be at least 64, got {cfg.cache_mib}")
    if cfg.repository and cfg.repository.startswith(("oss://", "s3://")):
        query = parse_qs(urlparse(cfg.repository).query)
        if not query.get("region"):
            raise ConfigError("an oss repository needs its region given explicitly: "
                              "oss://BUCKET/PREFIX?endpoint=URL&region=REGION")
    if len(str(cfg.run_dir)) > 60:
        raise ConfigError(f"run_dir {cfg.run_dir} is too long for unix socket paths "
                          "(keep it under 60 characters)")


def _validate_tls(cfg: Config) -> None:
    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if cfg.tls_cert is not None and not cfg.tls:
        raise ConfigError("--tls-cert is a certificate to serve: it contradicts --no-tls")
    for path in (cfg.tls_cert, cfg.tls_key):
        if path is not None and not path.is_file():
            raise ConfigError(f"TLS file {path} does not exist")


def redact(url: str) -> str:
    """`url` without its password, for messages (a Redis URL carries one)."""
    parts = urlparse(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(netloc=f"{user}***@{host}").geturl()


def _validate_cluster(cfg: Config) -> None:
    if cfg.p2p and not cfg.cluster_redis:
        raise ConfigError("--p2p needs --cluster-redis: neighbours are the cluster's nodes")
    if cfg.cluster_redis and urlparse(cfg.cluster_redis).scheme not in ("redis", "rediss",
                                                                        "unix"):
        raise ConfigError(f"cluster_redis must be a redis:// URL, got "
                          f"{redact(cfg.cluster_redis)!r}")
    for name in ("advertise_url", "advertise_proxy_url"):
        url = getattr(cfg, name)
        if url and urlparse(url).scheme not in ("http", "https"):
            raise ConfigError(f"{name} must be an http(s) URL, got {url!r}")
    if cfg.node_id is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                                                cfg.node_id):
        raise ConfigError(f"node_id must be letters, digits, '.', '_' or '-', got "
                          f"{cfg.node_id!r}")
    if cfg.heartbeat_s <= 0 or cfg.heartbeat_misses < 2:
        raise ConfigError("heartbeat_s > 0 and heartbeat_misses >= 2")
