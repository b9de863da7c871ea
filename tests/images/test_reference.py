"""Without a registry: reference parsing, where a reference is fetched from (mirror,
insecure registries), skopeo error translation, chain ids, platform selection, configs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from host.images import (
    ImageError,
    ImageNotFound,
    ImageReferenceError,
    Reference,
    RegistryAuthError,
    RegistryConfig,
    RegistryUnavailable,
    Source,
    UnsupportedImage,
    chain_ids,
    is_insecure,
    parse_reference,
    resolve_source,
)
from host.images.layout import check_layers, manifest_kind, parse_config, select_platform
from host.images.skopeo import MIRROR_HINT, classify, error_message, parse_copy_line

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("text", "expected"), [
    ("busybox", Reference("docker.io", "library/busybox", "latest")),
    ("busybox:1.36", Reference("docker.io", "library/busybox", "1.36")),
    ("docker.io/library/python:3.12", Reference("docker.io", "library/python", "3.12")),
    ("index.docker.io/user/app", Reference("docker.io", "user/app", "latest")),
    ("docker://user/app:v1", Reference("docker.io", "user/app", "v1")),
    ("127.0.0.1:5000/x:tag", Reference("127.0.0.1:5000", "x", "tag")),
    ("localhost/x", Reference("localhost", "x", "latest")),
    ("localhost:5000/a/b/c", Reference("localhost:5000", "a/b/c", "latest")),
    ("[::1]:5000/x", Reference("[::1]:5000", "x", "latest")),
    ("ghcr.io/o/r@" + DIGEST, Reference("ghcr.io", "o/r", None, DIGEST)),
    ("ghcr.io/o/r:t@" + DIGEST, Reference("ghcr.io", "o/r", "t", DIGEST)),
    ("my-registry.example.com:443/team/app_x.y-z:1.0-rc", Reference(
        "my-registry.example.com:443", "team/app_x.y-z", "1.0-rc")),
])
def test_parse_reference(text: str, expected: Reference) -> None:
    assert parse_reference(text) == expected


def test_reference_str_and_host() -> None:
    assert str(parse_reference("busybox")) == "docker.io/library/busybox:latest"
    assert str(parse_reference("h:1/x@" + DIGEST)) == f"h:1/x@{DIGEST}"
    assert parse_reference("[::1]:5000/x").host == "::1"
    assert parse_reference("127.0.0.1:5000/x").host == "127.0.0.1"


@pytest.mark.parametrize("text", ["", "  ", "Busybox", "busybox:", "busybox@sha256:12",
                                  "a//b", "host:5000/", "-x", "x:" + "t" * 200,
                                  "bad host:1/x", "a" * 300])
def test_invalid_references(text: str) -> None:
    with pytest.raises(ImageReferenceError):
        parse_reference(text)


def config(tmp_path: Path, **kw: object) -> RegistryConfig:
    return RegistryConfig(cache_dir=tmp_path, **kw)  # type: ignore[arg-type]


def test_hub_names_go_through_the_mirror(tmp_path: Path) -> None:
    cfg = config(tmp_path, mirror="http://127.0.0.1:5000")
    assert resolve_source(parse_reference("busybox"), cfg) == Source(
        "127.0.0.1:5000", "library/busybox", tls_verify=False, via_mirror=True)
    assert resolve_source(parse_reference("ghcr.io/o/r"), cfg) == Source(
        "ghcr.io", "o/r", tls_verify=True)
    https = config(tmp_path, mirror="https://mirror.example.com/hub/")
    assert resolve_source(parse_reference("user/app"), https) == Source(
        "mirror.example.com", "hub/user/app", tls_verify=True, via_mirror=True)
    bare = config(tmp_path, mirror="mirror.example.com:5000")
    assert resolve_source(parse_reference("busybox"), bare).tls_verify is True


def test_hub_without_mirror_goes_to_docker_io(tmp_path: Path) -> None:
    assert resolve_source(parse_reference("python:3.12"), config(tmp_path)) == Source(
        "docker.io", "library/python", tls_verify=True)


def test_invalid_mirror(tmp_path: Path) -> None:
    with pytest.raises(ImageReferenceError, match="mirror"):
        resolve_source(parse_reference("busybox"), config(tmp_path, mirror="ftp://x"))


@pytest.mark.parametrize(("registry", "insecure"), [
    ("127.0.0.1:5000", True), ("127.8.9.10", True), ("localhost:5000", True),
    ("localhost", True), ("[::1]:5000", True), ("reg.localhost:80", True),
    ("10.0.0.5:5000", False), ("ghcr.io", False), ("docker.io", False),
    ("listed.example.com", True), ("listed.example.com:8443", True),
    ("port.example.com:5000", True), ("port.example.com:5001", False),
    ("192.168.7.8:5000", True), ("192.168.8.1", False),
])
def test_insecure_registries(tmp_path: Path, registry: str, insecure: bool) -> None:
    cfg = config(tmp_path, insecure_registries=("listed.example.com", "port.example.com:5000",
                                                "192.168.7.0/24"))
    assert is_insecure(registry, cfg) is insecure


# --- skopeo output -------------------------------------------------------------------

SOURCE = Source("127.0.0.1:5000", "x", tls_verify=False)


def fatal(msg: str) -> str:
    escaped = msg.replace('"', '\\"')
    return f'time="2026-01-01T00:00:00Z" level=fatal msg="{escaped}"\n'


def test_error_message_unescapes_the_fatal_line() -> None:
    err = ('time="x" level=warning msg="Failed, retrying"\n'
           + fatal('Error parsing image name "docker://h/x:1": manifest unknown'))
    assert error_message(err) == 'Error parsing image name "docker://h/x:1": manifest unknown'
    assert error_message("plain\nlast line\n") == "last line"


@pytest.mark.parametrize(("stderr", "kind", "creds"), [
    (fatal("reading manifest 2 in h/x: manifest unknown: manifest unknown"), ImageNotFound,
     False),
    (fatal("reading manifest 1 in h/x: name unknown: repository name not known to registry"),
     ImageNotFound, False),
    (fatal("reading manifest 1 in h/x: unauthorized: authentication required"),
     RegistryAuthError, False),
    (fatal("reading manifest 1 in h/x: requested access to the resource is denied"),
     RegistryAuthError, True),
    (fatal('pinging container registry h: Get "http://h/v2/": dial tcp h: connect: '
           "connection refused"), RegistryUnavailable, False),
    (fatal('pinging container registry h: Get "https://h/v2/": http: server gave HTTP '
           "response to HTTPS client"), RegistryUnavailable, False),
    (fatal("reading blob sha256:00: fetching blob: received unexpected HTTP status: "
           "503 Service Unavailable"), RegistryUnavailable, False),
    (fatal("something else entirely"), ImageError, False),
])
def test_classify(stderr: str, kind: type[ImageError], creds: bool) -> None:
    exc = classify(stderr, reference="r", source=SOURCE, with_credentials=creds,
                   hub_without_mirror=False)
    assert type(exc) is kind
    assert "'r'" in str(exc)


def test_auth_message_says_whether_credentials_were_sent() -> None:
    err = fatal("unauthorized: authentication required")
    sent = classify(err, reference="r", source=SOURCE, with_credentials=True,
                    hub_without_mirror=False)
    unsent = classify(err, reference="r", source=SOURCE, with_credentials=False,
                      hub_without_mirror=False)
    assert "rejected the credentials" in str(sent)
    assert "requires credentials" in str(unsent)


def test_offline_docker_hub_says_to_configure_a_mirror() -> None:
    err = fatal('pinging container registry registry-1.docker.io: Get "https://registry-1.'
                'docker.io/v2/": dial tcp: lookup registry-1.docker.io: no such host')
    exc = classify(err, reference="busybox", source=Source("docker.io", "library/busybox",
                                                            True),
                   hub_without_mirror=True, with_credentials=False)
    assert isinstance(exc, RegistryUnavailable)
    assert MIRROR_HINT in str(exc) and "registry_mirror" in str(exc)


def test_plain_http_registry_hint() -> None:
    err = fatal('Get "https://h/v2/": http: server gave HTTP response to HTTPS client')
    exc = classify(err, reference="r", source=Source("h:5000", "x", True),
                   hub_without_mirror=False, with_credentials=False)
    assert "insecure_registries" in str(exc)


def test_parse_copy_line() -> None:
    line = parse_copy_line("Copying blob sha256:" + "a" * 64 + "\n")
    assert line is not None and (line.kind, line.skipped) == ("blob", False)
    skipped = parse_copy_line("Copying blob sha256:" + "b" * 64 + " skipped: already exists")
    assert skipped is not None and skipped.skipped
    config_line = parse_copy_line("Copying config sha256:" + "c" * 64 + " done")
    assert config_line is not None and config_line.kind == "config"
    assert parse_copy_line("Writing manifest to image destination") is None


# --- image documents -----------------------------------------------------------------

def test_chain_ids_follow_the_oci_definition() -> None:
    d = ["sha256:" + c * 64 for c in "123"]
    c1 = "sha256:" + hashlib.sha256(f"{d[0]} {d[1]}".encode()).hexdigest()
    c2 = "sha256:" + hashlib.sha256(f"{c1} {d[2]}".encode()).hexdigest()
    assert chain_ids(d) == [d[0], c1, c2]
    assert chain_ids([]) == []
    assert chain_ids(d[:2]) == chain_ids(d)[:2]


def _index(*platforms: dict[str, str]) -> dict[str, object]:
    return {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "digest": f"sha256:{i:064x}", "size": 1, "platform": p}
                          for i, p in enumerate(platforms)]}


def test_select_platform() -> None:
    index = _index({"os": "linux", "architecture": "arm64", "variant": "v8"},
                   {"os": "windows", "architecture": "amd64"},
                   {"os": "unknown", "architecture": "unknown"},
                   {"os": "linux", "architecture": "amd64"})
    desc = select_platform(index, os="linux", arch="amd64", variant=None, what="i")
    assert desc["digest"] == f"sha256:{3:064x}"
    arm = select_platform(index, os="linux", arch="arm64", variant="v8", what="i")
    assert arm["digest"] == f"sha256:{0:064x}"
    with pytest.raises(UnsupportedImage, match=r"no linux/s390x image \(it has: "
                       r"linux/arm64/v8, windows/amd64, unknown/unknown, linux/amd64\)"):
        select_platform(index, os="linux", arch="s390x", variant=None, what="i")


def test_manifest_kinds_and_unsupported_documents() -> None:
    assert manifest_kind(_index(), "i") == "index"
    assert manifest_kind({"schemaVersion": 2, "config": {}, "layers": []}, "i") == "manifest"
    with pytest.raises(UnsupportedImage, match="schema 1"):
        manifest_kind({"schemaVersion": 1, "fsLayers": []}, "i")
    with pytest.raises(UnsupportedImage, match="media type"):
        manifest_kind({"schemaVersion": 2, "mediaType": "application/x-foo"}, "i")


@pytest.mark.parametrize(("config_type", "layer_type", "match"), [
    ("application/vnd.cncf.helm.config.v1+json", "application/vnd.oci.image.layer.v1.tar",
     "not a container image"),
    ("application/vnd.oci.image.config.v1+json",
     "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip", "unsupported media"),
    ("application/vnd.oci.image.config.v1+json",
     "application/vnd.oci.image.layer.v1.tar+gzip+encrypted", "unsupported media"),
])
def test_unsupported_layers(config_type: str, layer_type: str, match: str) -> None:
    manifest = {"schemaVersion": 2, "config": {"mediaType": config_type},
                "layers": [{"mediaType": layer_type}]}
    with pytest.raises(UnsupportedImage, match=match):
        check_layers(manifest, "i")


def test_parse_config() -> None:
    cfg = parse_config({"config": {
        "Env": ["A=1", "B=x=y", "A=2", "EMPTY="], "WorkingDir": "/w", "User": "app",
        "Entrypoint": None, "Cmd": "sh", "ExposedPorts": {"80/tcp": {}, "443/tcp": {}}}})
    assert cfg.env_map() == {"A": "2", "B": "x=y", "EMPTY": ""}
    assert (cfg.working_dir, cfg.user, cfg.entrypoint, cfg.cmd) == ("/w", "app", (), ("sh",))
    assert cfg.exposed_ports == ("443/tcp", "80/tcp")
    assert parse_config({}).env == ()
