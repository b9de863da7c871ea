"""pull() against real registries on 127.0.0.1 (Debian's docker-registry) holding images
the tests built: digests, chain ids, configs, platform choice, mirror, auth, errors,
cache reuse and repair, progress; and the pulled layers applied with apply.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from host.contract import RegistryAuth
from host.images import (
    ImageError,
    ImageNotFound,
    PullProgress,
    RegistryAuthError,
    RegistryConfig,
    RegistryUnavailable,
    UnsupportedImage,
    open_layer,
    pull,
)
from host.images.apply import apply_layer

from .conftest import PASSWORD, USER, PushedImages, Registry, _free_port


@pytest.fixture
def cfg(tmp_path: Path) -> RegistryConfig:
    return RegistryConfig(cache_dir=tmp_path / "cache", retries=0)


async def test_busybox_image(registry: Registry, images: PushedImages,
                             cfg: RegistryConfig) -> None:
    image = await pull(f"{registry.host}/busybox:1", cfg)
    assert image.digest == images.busybox.digest == image.manifest_digest
    assert image.index_digest is None
    assert image.config_digest == images.busybox.config_digest
    assert image.name == f"{registry.host}/busybox:1"
    assert image.source == f"{registry.host}/busybox"
    assert (image.os, image.architecture) == ("linux", "amd64")
    [layer] = image.layers
    assert layer.digest == images.busybox.layer_digests[0]
    assert layer.diff_id == layer.chain_id == images.busybox.diff_ids[0]
    assert (layer.compression, layer.media_type) == (
        "gzip", "application/vnd.oci.image.layer.v1.tar+gzip")
    assert layer.path == cfg.blobs_dir / "sha256" / layer.digest[7:]
    assert layer.size == layer.path.stat().st_size
    c = image.config
    assert c.env_map() == {"PATH": "/usr/local/bin:/bin", "GREETING": "hello world",
                           "EMPTY": ""}
    assert (c.working_dir, c.user) == ("/srv", "1000:1000")
    assert (c.entrypoint, c.cmd) == (("/bin/sh", "-c"), ("echo hi",))
    assert c.exposed_ports == ("53/udp", "8080/tcp")
    assert c.labels == {"org.example.test": "yes"}
    assert list(cfg.tmp_dir.iterdir()) == []   # no auth file or layout left behind


async def test_images_sharing_a_base_share_chain_ids_and_blobs(
        registry: Registry, images: PushedImages, cfg: RegistryConfig) -> None:
    busybox = await pull(f"{registry.host}/busybox:1", cfg)
    app1 = await pull(f"{registry.host}/app1:1", cfg)
    app2 = await pull(f"{registry.host}/app2:1", cfg)   # pushed as a Docker v2s2 manifest
    assert app1.layers[0].chain_id == app2.layers[0].chain_id == busybox.chain_id
    assert app1.layers[0].path == app2.layers[0].path == busybox.layers[0].path
    assert app1.layers[1].chain_id != app2.layers[1].chain_id
    assert [la.diff_id for la in app2.layers] == images.app2.diff_ids
    expected = hashlib.sha256(
        f"{images.app1.diff_ids[0]} {images.app1.diff_ids[1]}".encode()).hexdigest()
    assert app1.chain_id == f"sha256:{expected}"
    # skopeo stored app2's Docker manifest as OCI: another manifest digest, same layers
    assert app2.manifest_digest != app2.digest
    assert [la.digest for la in app2.layers] == images.app2.layer_digests
    assert app1.config.cmd == ("/app/one",) and app2.config.cmd == ("/app/two",)


async def test_multi_arch_index_picks_linux_amd64(registry: Registry, images: PushedImages,
                                                  cfg: RegistryConfig) -> None:
    image = await pull(f"{registry.host}/multi:1", cfg)
    assert image.index_digest == images.multi_index
    assert image.digest == images.multi_amd64.digest
    assert image.config.env_map() == {"ARCH": "amd64"}
    assert [la.diff_id for la in image.layers] == images.multi_amd64.diff_ids
    arm = RegistryConfig(cache_dir=cfg.cache_dir, arch="arm64", retries=0)
    arm_image = await pull(f"{registry.host}/multi:1", arm)
    assert arm_image.architecture == "arm64" and arm_image.digest != image.digest


async def test_single_image_for_another_arch_is_unsupported(
        registry: Registry, images: PushedImages, cfg: RegistryConfig) -> None:
    with pytest.raises(UnsupportedImage, match="linux/arm64"):
        await pull(f"{registry.host}/arm:1", cfg)


async def test_unsupported_layer_type_fails_before_downloading(
        registry: Registry, images: PushedImages, cfg: RegistryConfig) -> None:
    with pytest.raises(UnsupportedImage, match="application/vnd.example.unknown"):
        await pull(f"{registry.host}/weird:1", cfg)
    assert not (cfg.blobs_dir / "sha256" / images.weird.layer_digests[0][7:]).exists()


@pytest.mark.parametrize("name", ["busybox:nope", "nothere:1",
                                  "busybox@sha256:" + "0" * 64])
async def test_missing_image(registry: Registry, images: PushedImages, cfg: RegistryConfig,
                             name: str) -> None:
    with pytest.raises(ImageNotFound, match=f"not found at {registry.host}"):
        await pull(f"{registry.host}/{name}", cfg)


async def test_registry_credentials(auth_registry: Registry, images: PushedImages,
                                    cfg: RegistryConfig) -> None:
    ref = f"{auth_registry.host}/private/busybox:1"
    image = await pull(ref, cfg, credentials=RegistryAuth(USER, PASSWORD))
    assert image.digest == images.busybox.digest
    with pytest.raises(RegistryAuthError, match="rejected the credentials"):
        await pull(ref, RegistryConfig(cache_dir=cfg.cache_dir / "2", retries=0),
                   credentials=RegistryAuth(USER, "wrong"))
    with pytest.raises(RegistryAuthError, match="requires credentials"):
        await pull(ref, RegistryConfig(cache_dir=cfg.cache_dir / "3", retries=0))
    assert list(cfg.tmp_dir.iterdir()) == []


async def test_unreachable_registry(cfg: RegistryConfig) -> None:
    with pytest.raises(RegistryUnavailable, match="connection refused"):
        await pull(f"127.0.0.1:{_free_port()}/x:1", cfg)


async def test_docker_hub_names_through_the_mirror(registry: Registry, images: PushedImages,
                                                   tmp_path: Path) -> None:
    cfg = RegistryConfig(cache_dir=tmp_path / "c", mirror=f"http://{registry.host}",
                         retries=0)
    for ref in ("busybox:1", "docker.io/library/busybox:1", "index.docker.io/busybox:1"):
        image = await pull(ref, cfg)
        assert image.digest == images.busybox.digest
        assert image.name == "docker.io/library/busybox:1"
        assert image.source == f"{registry.host}/library/busybox"
    with pytest.raises(ImageNotFound, match="Docker Hub mirror"):
        await pull("busybox:2", cfg)


async def test_digest_references_resolve_from_the_cache(
        registry: Registry, images: PushedImages, cfg: RegistryConfig) -> None:
    by_digest = f"{registry.host}/busybox@{images.busybox.digest}"
    first = await pull(by_digest, cfg)
    index_ref = f"{registry.host}/multi@{images.multi_index}"
    multi = await pull(index_ref, cfg)
    offline = RegistryConfig(cache_dir=cfg.cache_dir, skopeo="/nonexistent/skopeo")
    events: list[PullProgress] = []
    again = await pull(by_digest, offline, progress=events.append)
    assert again == first
    assert [e.phase for e in events] == ["resolve", "done"]
    assert (await pull(index_ref, offline)).digest == multi.digest == images.multi_amd64.digest
    with pytest.raises(ImageError, match="skopeo"):   # a tag always asks the registry
        await pull(f"{registry.host}/busybox:1", offline)


async def test_progress_reports(registry: Registry, images: PushedImages,
                                cfg: RegistryConfig) -> None:
    events: list[PullProgress] = []
    image = await pull(f"{registry.host}/app1:1", cfg, progress=events.append)
    phases = [e.phase for e in events]
    assert phases[0] == "resolve" and phases[-1] == "done"
    assert phases.index("download") < phases.index("verify") < phases.index("done")
    downloads = [e for e in events if e.phase == "download"]
    assert {e.blobs_total for e in downloads} == {2}
    assert {e.bytes_total for e in downloads} == {image.size}
    assert any(e.message.startswith("copying blob") for e in downloads)
    assert downloads[-1].blobs_done == 2 and downloads[-1].bytes_done == image.size
    assert [e.bytes_done for e in downloads] == sorted(e.bytes_done for e in downloads)
    done = events[-1]
    assert (done.blobs_done, done.bytes_done) == (2, image.size)

    events.clear()   # app2 shares the busybox layer: it is already in the cache
    await pull(f"{registry.host}/app2:1", cfg, progress=events.append)
    first = next(e for e in events if e.phase == "download")
    assert first.blobs_done == 1 and "1 already cached" in first.message


async def test_corrupt_cached_layer_is_fetched_again(
        registry: Registry, images: PushedImages, cfg: RegistryConfig) -> None:
    image = await pull(f"{registry.host}/busybox:1", cfg)
    path = image.layers[0].path
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    again = await pull(f"{registry.host}/busybox:1", cfg)
    assert hashlib.sha256(again.layers[0].path.read_bytes()).hexdigest() == \
        image.layers[0].digest[7:]


async def test_zstd_layers_are_decompressed_for_the_guest(
        registry: Registry, images: PushedImages, cfg: RegistryConfig, tmp_path: Path) -> None:
    image = await pull(f"{registry.host}/zstd:1", cfg)
    [layer] = image.layers
    assert layer.compression == "zstd"
    with open_layer(layer) as stream:
        data = stream.read()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == layer.diff_id
    root = tmp_path / "root"
    root.mkdir()
    with open_layer(layer) as stream:
        apply_layer(stream, str(root), expect_diff_id=layer.diff_id)
    assert (root / "z/data").read_bytes() == b"zstd layer\n" * 100


async def test_pulled_layers_apply_into_a_working_root(
        registry: Registry, images: PushedImages, cfg: RegistryConfig, tmp_path: Path) -> None:
    image = await pull(f"{registry.host}/app1:1", cfg)
    root = tmp_path / "root"
    root.mkdir()
    for layer in image.layers:
        with open_layer(layer) as stream:
            summary = apply_layer(stream, str(root), expect_diff_id=layer.diff_id)
        assert summary["diff_id"] == layer.diff_id
    assert stat.S_IMODE((root / "bin/busybox").stat().st_mode) == 0o755
    assert os.readlink(root / "bin/sh") == "busybox"
    assert (root / "app/one").read_bytes() == b"1\n"
    out = await asyncio.to_thread(subprocess.run, [str(root / "bin/busybox"), "echo", "hi"],
                                  capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout == "hi\n"


# --- skopeo's command line (a fake skopeo records it) ---------------------------------

FAKE_SKOPEO = """\
import json, os, sys, time
argv = sys.argv[1:]
record = {"argv": argv, "env_auth": os.environ.get("REGISTRY_AUTH_FILE"), "pid": os.getpid()}
for flag in ("--authfile", "--src-authfile"):
    if flag in argv:
        path = argv[argv.index(flag) + 1]
        record["auth_mode"] = oct(os.stat(path).st_mode & 0o777)
        record["auth"] = json.load(open(path))
with open(os.environ["FAKE_SKOPEO_LOG"], "a") as f:
    f.write(json.dumps(record) + "\\n")
if os.environ.get("FAKE_SKOPEO_SLEEP"):
    time.sleep(60)
sys.stderr.write('time="t" level=fatal msg="reading manifest 1 in h/x: manifest unknown"\\n')
sys.exit(1)
"""


@pytest.fixture
def fake_skopeo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    exe = tmp_path / "fake-skopeo"
    exe.write_text(f"#!{sys.executable}\n{FAKE_SKOPEO}")
    exe.chmod(0o755)
    log = tmp_path / "skopeo.log"
    monkeypatch.setenv("FAKE_SKOPEO_LOG", str(log))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", "/should/not/leak")
    return exe, log


async def test_password_never_on_the_command_line(tmp_path: Path,
                                                  fake_skopeo: tuple[Path, Path]) -> None:
    exe, log = fake_skopeo
    cfg = RegistryConfig(cache_dir=tmp_path / "c", skopeo=str(exe), retries=0)
    with pytest.raises(ImageNotFound):
        await pull("127.0.0.1:5999/x:1", cfg, credentials=RegistryAuth("bob", "hunter2"))
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert not any("hunter2" in a for a in record["argv"])
    assert record["auth_mode"] == "0o600"
    assert record["auth"] == {"auths": {"127.0.0.1:5999": {"auth": "Ym9iOmh1bnRlcjI="}}}
    assert record["env_auth"] is None
    argv = record["argv"]
    assert "--tls-verify=false" in argv   # loopback
    assert argv[argv.index("--override-arch") + 1] == "amd64"
    assert argv[-1] == "docker://127.0.0.1:5999/x:1"
    assert list(cfg.tmp_dir.iterdir()) == []


async def test_anonymous_pull_uses_no_credentials_and_verifies_tls(
        tmp_path: Path, fake_skopeo: tuple[Path, Path]) -> None:
    exe, log = fake_skopeo
    cfg = RegistryConfig(cache_dir=tmp_path / "c", skopeo=str(exe), retries=0)
    with pytest.raises(ImageNotFound):
        await pull("registry.example.com/x:1", cfg)
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert "--no-creds" in record["argv"] and "--tls-verify=true" in record["argv"]


async def test_cancelling_a_pull_kills_skopeo(tmp_path: Path, fake_skopeo: tuple[Path, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    exe, log = fake_skopeo
    monkeypatch.setenv("FAKE_SKOPEO_SLEEP", "1")
    cfg = RegistryConfig(cache_dir=tmp_path / "c", skopeo=str(exe), retries=0)
    task = asyncio.create_task(pull("127.0.0.1:5999/x:1", cfg))
    for _ in range(200):
        if log.exists() and log.read_text():
            break
        await asyncio.sleep(0.05)
    pid = json.loads(log.read_text())["pid"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert list(cfg.tmp_dir.iterdir()) == []
