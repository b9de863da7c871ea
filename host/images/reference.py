"""Image references: parsing and normalising names the way Docker does.

    busybox                         -> docker.io/library/busybox:latest
    user/app:1                      -> docker.io/user/app:1
    127.0.0.1:5000/x:tag            -> 127.0.0.1:5000/x:tag
    ghcr.io/o/r@sha256:<hex>        -> ghcr.io/o/r@sha256:<hex>
    localhost/x, [::1]:5000/x       -> a registry host (it has '.', ':', or is localhost)

A first path component is a registry host when it contains '.' or ':', is `localhost`,
or is an IPv6 literal in brackets; otherwise the name is on Docker Hub (`docker.io`),
where one-component names live under `library/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ImageReferenceError

DOCKER_HUB = "docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = re.compile(
    rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[\w][\w.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_NAME = 255


@dataclass(frozen=True)
class Reference:
    """A normalised image reference. `tag` is None only when `digest` is set; with both,
    the digest decides what is pulled and the tag is informational."""

    registry: str      # "docker.io", "127.0.0.1:5000", "[::1]:5000", "localhost"
    repository: str    # "library/busybox"
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """`registry/repository` without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def host(self) -> str:
        """The registry host without port or IPv6 brackets."""
        if self.registry.startswith("["):
            return self.registry[1:self.registry.index("]")]
        return self.registry.rsplit(":", 1)[0] if ":" in self.registry else self.registry

    @property
    def is_docker_hub(self) -> bool:
        return self.registry == DOCKER_HUB

    def __str__(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def parse_reference(text: str) -> Reference:
    """Parse and normalise `text`; raises ImageReferenceError with the reason."""
    original = text
    text = text.strip()
    text = text.removeprefix("docker://")
    if not text:
        raise ImageReferenceError("empty image reference")

    digest: str | None = None
    if "@" in text:
        text, digest = text.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise ImageReferenceError(
                f"invalid digest in image reference {original!r}: expected sha256:<64 hex>")

    registry, rest = _split_registry(text)
    tag: str | None = None
    last_slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > last_slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise ImageReferenceError(f"invalid tag {tag!r} in image reference {original!r}")

    if not rest:
        raise ImageReferenceError(f"image reference {original!r} has no repository name")
    for component in rest.split("/"):
        if not _PATH_COMPONENT.fullmatch(component):
            raise ImageReferenceError(
                f"invalid repository name {rest!r} in image reference {original!r} "
                "(lowercase letters, digits and separators . _ __ - only)")
    if registry is None or registry in _HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in rest:
            rest = f"library/{rest}"
    if len(registry) + 1 + len(rest) > _MAX_NAME:
        raise ImageReferenceError(f"image name in {original!r} is longer than {_MAX_NAME}")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry=registry, repository=rest, tag=tag, digest=digest)


def _split_registry(text: str) -> tuple[str | None, str]:
    """(registry or None, remainder) as Docker decides it."""
    slash = text.find("/")
    if slash < 0:
        return None, text
    first = text[:slash]
    is_host = ("." in first or ":" in first or first == "localhost"
               or first.startswith("[") or first != first.lower())
    if not is_host:
        return None, text
    if not _DOMAIN.fullmatch(first):
        raise ImageReferenceError(f"invalid registry host {first!r} in image reference {text!r}")
    return first, text[slash + 1:]
