"""Fixtures: real registries (Debian's `docker-registry`, distribution 2.8) on 127.0.0.1,
one open and one behind htpasswd auth, each started once per session in its own process
group and always killed and reaped; and the test images pushed into them once.

    registry       open registry, plain HTTP              (skips without docker-registry)
    auth_registry  htpasswd registry: alice / s3cret       (also needs bcrypt or htpasswd)
    images         the pushed test images, by name         (also needs skopeo)
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .ocibuild import BUSYBOX, BuiltImage, LayerTar, OciLayout, busybox_layer, push

REGISTRY_BIN = "/usr/bin/docker-registry"
USER, PASSWORD = "alice", "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    """One registry process: `host` is "127.0.0.1:PORT"."""

    host: str
    proc: subprocess.Popen[bytes]
    authfile: Path | None = None


def _htpasswd_line(user: str, password: str) -> str:
    try:
        import bcrypt  # type: ignore[import-not-found]
    except ImportError:
        exe = shutil.which("htpasswd")
        if exe is None:
            pytest.skip("neither python bcrypt nor htpasswd (apache2-utils) is installed")
        out = subprocess.run([exe, "-nbB", user, password], capture_output=True, text=True,
                             check=True).stdout
        return out.strip() + "\n"
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()
    return f"{user}:{hashed}\n"


def _start(root: Path, *, htpasswd: Path | None) -> Registry:
    if not os.access(REGISTRY_BIN, os.X_OK):
        pytest.skip(f"{REGISTRY_BIN} missing (apt-get install docker-registry)")
    port = _free_port()
    auth = (f"auth:\n  htpasswd:\n    realm: test\n    path: {htpasswd}\n"
            if htpasswd else "")
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: test-secret\n" + auth)
    log = open(root / "registry.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=log,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1):
                break
        except urllib.error.HTTPError:
            break  # 401 from the auth registry: it is up
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError("registry did not start: "
                                   + (root / "registry.log").read_text()[-2000:]) from None
            time.sleep(0.05)
    return Registry(f"127.0.0.1:{port}", proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An open registry on 127.0.0.1 (plain HTTP); killed and reaped at session end."""
    reg = _start(tmp_path_factory.mktemp("registry"), htpasswd=None)
    try:
        yield reg
    finally:
        _stop(reg.proc)


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry that wants alice/s3cret (htpasswd, bcrypt); `authfile` holds them for
    pushing. Killed and reaped at session end."""
    root = tmp_path_factory.mktemp("auth-registry")
    htpasswd = root / "htpasswd"
    htpasswd.write_text(_htpasswd_line(USER, PASSWORD))
    reg = _start(root, htpasswd=htpasswd)
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    reg.authfile = root / "push-auth.json"
    reg.authfile.write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
    try:
        yield reg
    finally:
        _stop(reg.proc)


@dataclass
class PushedImages:
    """What the `images` fixture pushed, by role."""

    busybox: BuiltImage
    app1: BuiltImage          # busybox layer + its own layer (OCI manifest)
    app2: BuiltImage          # busybox layer + another layer (pushed as Docker v2s2)
    arm: BuiltImage           # linux/arm64 only
    multi_index: str          # digest of the index: arm64 first, amd64 second
    multi_amd64: BuiltImage
    zstd: BuiltImage
    weird: BuiltImage         # a layer of an unknown media type
    config: dict[str, object]


BUSYBOX_CONFIG: dict[str, object] = {
    "Env": ["PATH=/usr/local/bin:/bin", "GREETING=hello world", "EMPTY="],
    "WorkingDir": "/srv",
    "User": "1000:1000",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo hi"],
    "ExposedPorts": {"8080/tcp": {}, "53/udp": {}},
    "Labels": {"org.example.test": "yes"},
}


@pytest.fixture(scope="session")
def images(registry: Registry, auth_registry: Registry,
           tmp_path_factory: pytest.TempPathFactory) -> PushedImages:
    """Test images pushed once per session:

    busybox:1 (and library/busybox:1 for the mirror) · app1:1 / app2:1 sharing the busybox
    layer · arm:1 (arm64 only) · multi:1 (index, amd64 second) · zstd:1 · weird:1 (unknown
    layer media type) · and private/busybox:1 in the auth registry. All are linux/amd64 unless named otherwise."""
    if shutil.which("skopeo") is None:
        pytest.skip("skopeo missing (apt-get install skopeo)")
    if not BUSYBOX.exists():
        pytest.skip("/bin/busybox missing (apt-get install busybox-static)")
    layout = OciLayout(tmp_path_factory.mktemp("layout") / "oci")
    base = busybox_layer()
    busybox = layout.image([base], config=BUSYBOX_CONFIG)
    app1 = layout.image([base, LayerTar().dir("app").file("app/one", b"1\n").bytes()],
                        config={"Cmd": ["/app/one"]})
    app2 = layout.image([base, LayerTar().dir("app").file("app/two", b"2\n").bytes()],
                        config={"Cmd": ["/app/two"]})
    arm = layout.image([LayerTar().file("arm", b"arm64\n").bytes()], arch="arm64")
    amd = layout.image([LayerTar().file("amd", b"amd64\n").bytes()],
                       config={"Env": ["ARCH=amd64"]})
    index = layout.index([(arm, "linux", "arm64"), (amd, "linux", "amd64")])
    zstd = layout.image([LayerTar().dir("z").file("z/data", b"zstd layer\n" * 100).bytes()],
                        compression="zstd")
    weird = layout.image([LayerTar().file("w").bytes()],
                         layer_media_type="application/vnd.example.unknown")

    push(layout.tag("busybox", busybox.manifest), f"{registry.host}/busybox:1")
    push(layout.tag("busybox", busybox.manifest), f"{registry.host}/library/busybox:1")
    push(layout.tag("app1", app1.manifest), f"{registry.host}/app1:1")
    push(layout.tag("app2", app2.manifest), f"{registry.host}/app2:1", fmt="v2s2")
    push(layout.tag("arm", arm.manifest), f"{registry.host}/arm:1")
    push(layout.tag("multi", index), f"{registry.host}/multi:1", all_images=True)
    push(layout.tag("zstd", zstd.manifest), f"{registry.host}/zstd:1")
    push(layout.tag("weird", weird.manifest), f"{registry.host}/weird:1")
    push(layout.tag("busybox", busybox.manifest), f"{auth_registry.host}/private/busybox:1",
         authfile=auth_registry.authfile)
    return PushedImages(busybox=busybox, app1=app1, app2=app2, arm=arm,
                      multi_index=str(index["digest"]), multi_amd64=amd, zstd=zstd, weird=weird,
                      config=BUSYBOX_CONFIG)
