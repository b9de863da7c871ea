"""Registry settings and where a reference is fetched from.

`RegistryConfig` holds the node's pull options; `resolve_source()` turns a `Reference`
into the `Source` actually contacted: Docker Hub names go through `mirror` when one is
set (Docker's `registry-mirrors`, without the fallback to docker.io), everything else
goes to its own registry. TLS verification is off only for registries listed in
`insecure_registries` (host, host:port or a CIDR, as in Docker's daemon.json), for
loopback registries (127.0.0.0/8, ::1, localhost), and for a mirror given as http://.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from .errors import ImageReferenceError
from .reference import Reference


class Credentials(Protocol):
    """A username and password (`host.contract.RegistryAuth` is one)."""

    @property
    def username(self) -> str: ...

    @property
    def password(self) -> str: ...


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    """Pull options of a node.

    `cache_dir` holds the OCI cache (`blobs/sha256/<hex>` shared by all images,
    `images/<hex>/` one OCI layout per pulled manifest, `tmp/`). `mirror` serves Docker
    Hub names, e.g. "http://127.0.0.1:5000" or "https://mirror.example.com/prefix".
    `auth_file` is a containers-auth.json / Docker config.json used when a pull brings
    no credentials of its own. `retries` is skopeo's --retry-times for network errors."""

    cache_dir: Path
    mirror: str | None = None
    insecure_registries: tuple[str, ...] = ()
    os: str = "linux"
    arch: str = "amd64"
    variant: str | None = None
    auth_file: Path | None = None
    retries: int = 2
    skopeo: str = "skopeo"

    @property
    def blobs_dir(self) -> Path:
        return self.cache_dir / "blobs"

    @property
    def images_dir(self) -> Path:
        return self.cache_dir / "images"

    @property
    def tmp_dir(self) -> Path:
        return self.cache_dir / "tmp"

    @property
    def platform(self) -> str:
        return f"{self.os}/{self.arch}" + (f"/{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Source:
    """Where a reference is fetched from: `registry` (host[:port]) and `repository`
    as sent on the wire, whether TLS is verified, and whether this is the mirror."""

    registry: str
    repository: str
    tls_verify: bool
    via_mirror: bool = False

    def docker_ref(self, tag_or_digest: str) -> str:
        """skopeo's `docker://` name for a tag or a `sha256:` digest."""
        sep = "@" if tag_or_digest.startswith("sha256:") else ":"
        return f"docker://{self.registry}/{self.repository}{sep}{tag_or_digest}"


def resolve_source(ref: Reference, config: RegistryConfig) -> Source:
    """The registry and repository to contact for `ref` under `config`."""
    if ref.is_docker_hub and config.mirror:
        registry, prefix, secure = _parse_mirror(config.mirror)
        repository = f"{prefix}/{ref.repository}" if prefix else ref.repository
        tls = secure and not is_insecure(registry, config)
        return Source(registry, repository, tls, via_mirror=True)
    return Source(ref.registry, ref.repository, not is_insecure(ref.registry, config))


def is_insecure(registry: str, config: RegistryConfig) -> bool:
    """True for a loopback registry or one listed in `config.insecure_registries`."""
    host = _host_of(registry)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    address = _ip(host)
    if address is not None and address.is_loopback:
        return True
    for entry in config.insecure_registries:
        entry = entry.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
        if entry in (registry, host):
            return True
        if "/" in entry and address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


def _parse_mirror(mirror: str) -> tuple[str, str, bool]:
    """(host[:port], path prefix, https?) of a mirror URL; no scheme means https."""
    url = urlsplit(mirror if "://" in mirror else f"https://{mirror}")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ImageReferenceError(
            f"registry mirror {mirror!r} must look like http://HOST:PORT or https://HOST")
    return url.netloc, url.path.strip("/"), url.scheme == "https"


def _host_of(registry: str) -> str:
    if registry.startswith("["):
        return registry[1:registry.index("]")]
    return registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None
