"""Running Debian's `skopeo`: argv, credentials, environment, error translation.

Credentials never appear on a command line (visible in /proc): they go to a 0600
auth.json in a private 0700 directory that is removed after the call. The host's own
containers configuration does not leak in: skopeo gets an empty registries.conf (no
short names, no mirrors: `RegistryConfig` decides those), an accept-anything policy
(we pin every pull by digest and verify every blob ourselves) and no default auth file.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from .errors import (
    ImageError,
    ImageNotFound,
    RegistryAuthError,
    RegistryUnavailable,
)
from .registry import Credentials, RegistryConfig, Source

_FATAL = re.compile(r'level=fatal msg="((?:[^"\\]|\\.)*)"')
_AUTH_CODE = re.compile(r"\b(401|403)\b")
_SERVER_CODE = re.compile(r"\b(429|500|502|503|504)\b")
_COPYING = re.compile(r"^Copying (blob|config) (sha256:[0-9a-f]{64})(.*)$")
MIRROR_HINT = ('set a Docker Hub mirror: registry_mirror (e.g. "http://127.0.0.1:5000"), '
               "or use an image from a reachable registry")


@dataclass(frozen=True)
class CopyLine:
    """One "Copying blob|config sha256:..." line of skopeo's output."""

    kind: str        # "blob" | "config"
    digest: str
    skipped: bool    # "skipped: already exists"


def parse_copy_line(line: str) -> CopyLine | None:
    m = _COPYING.match(line.strip())
    if m is None:
        return None
    return CopyLine(m.group(1), m.group(2), "skipped" in m.group(3))


def error_message(stderr: str) -> str:
    """The message of skopeo's last `level=fatal` line (or its last non-empty line)."""
    found = _FATAL.findall(stderr)
    if found:
        return str(json.loads(f'"{found[-1]}"'))
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else "skopeo failed without a message"


def classify(stderr: str, *, reference: str, source: Source, with_credentials: bool,
             hub_without_mirror: bool) -> ImageError:
    """Translate a failed skopeo call into the matching ImageError."""
    detail = error_message(stderr)
    low = detail.lower()
    where = f"{source.registry}/{source.repository}"
    mirror = " (the Docker Hub mirror)" if source.via_mirror else ""
    if any(s in low for s in ("manifest unknown", "name unknown", "not found",
                              "repository name not known", "no such image")):
        return ImageNotFound(f"image {reference!r} not found at {where}{mirror}: {detail}")
    if any(s in low for s in ("unauthorized", "authentication required", "denied",
                              "invalid username/password")) or _AUTH_CODE.search(low):
        if with_credentials:
            msg = f"registry {source.registry} rejected the credentials for {reference!r}"
        else:
            msg = (f"registry {source.registry} requires credentials for {reference!r} "
                   "(or the repository does not exist)")
        return RegistryAuthError(f"{msg}: {detail}")
    if any(s in low for s in ("pinging container registry", "connection refused",
                              "no such host", "i/o timeout", "timeout", "tls", "x509",
                              "certificate", "http response to https client",
                              "connection reset", "eof", "network is unreachable",
                              "no route to host", "toomanyrequests", "too many requests",
                              "bad gateway", "service unavailable")) or _SERVER_CODE.search(low):
        msg = f"registry {source.registry}{mirror} is unavailable for {reference!r}: {detail}"
        if hub_without_mirror:
            msg += f"; {MIRROR_HINT}"
        elif "http response to https client" in low:
            msg += ("; the registry speaks plain HTTP: list it in insecure_registries "
                    "(loopback registries are insecure by default)")
        return RegistryUnavailable(msg)
    return ImageError(f"pulling {reference!r} from {where}{mirror} failed: {detail}")


class Skopeo:
    """One skopeo binary with a node's RegistryConfig."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config

    def _binary(self) -> str:
        exe = shutil.which(self.config.skopeo)
        if exe is None:
            raise ImageError(f"{self.config.skopeo!r} not found: install skopeo "
                             "(apt-get install skopeo) to pull OCI images")
        return exe

    @asynccontextmanager
    async def _session(self, source: Source,
                       credentials: Credentials | None) -> AsyncIterator[tuple[Path, Path | None]]:
        """A private temp dir (config files) and the auth file to use, removed after."""
        self.config.tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="skopeo-", dir=self.config.tmp_dir))
        try:
            (tmp / "registries.conf").write_text("")
            (tmp / "policy.json").write_text(
                json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
            (tmp / "registries.d").mkdir()
            auth: Path | None = None
            if credentials is not None:
                auth = tmp / "auth.json"
                token = base64.b64encode(
                    f"{credentials.username}:{credentials.password}".encode()).decode()
                body = json.dumps({"auths": {source.registry: {"auth": token}}})
                fd = os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(body)
            elif self.config.auth_file is not None:
                auth = self.config.auth_file
            yield tmp, auth
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _global_args(self, tmp: Path) -> list[str]:
        args = [self._binary(), "--policy", str(tmp / "policy.json"),
                "--registries.d", str(tmp / "registries.d"), "--tmpdir", str(tmp),
                "--override-os", self.config.os, "--override-arch", self.config.arch]
        if self.config.variant:
            args += ["--override-variant", self.config.variant]
        return args

    def _env(self, tmp: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("REGISTRY_AUTH_FILE", "DOCKER_CONFIG", "CONTAINERS_CONF")}
        env["CONTAINERS_REGISTRIES_CONF"] = str(tmp / "registries.conf")
        env["HOME"] = str(tmp)  # no ~/.docker/config.json
        env["XDG_RUNTIME_DIR"] = str(tmp)
        return env

    async def inspect_raw(self, source: Source, tag_or_digest: str, *, reference: str,
                          credentials: Credentials | None, hub_without_mirror: bool) -> bytes:
        """The raw manifest or index `tag_or_digest` names, exactly as the registry serves it."""
        async with self._session(source, credentials) as (tmp, auth):
            argv = [*self._global_args(tmp), "inspect", "--raw",
                    f"--tls-verify={'true' if source.tls_verify else 'false'}",
                    "--retry-times", str(self.config.retries)]
            argv += ["--authfile", str(auth)] if auth else ["--no-creds"]
            argv.append(source.docker_ref(tag_or_digest))
            rc, out, err = await _run(argv, self._env(tmp), on_line=None)
        if rc != 0:
            raise classify(err, reference=reference, source=source,
                           with_credentials=credentials is not None,
                           hub_without_mirror=hub_without_mirror)
        return out

    async def copy(self, source: Source, digest: str, layout: Path, *, reference: str,
                   credentials: Credentials | None, hub_without_mirror: bool,
                   on_line: Callable[[CopyLine], None] | None = None) -> None:
        """Copy the manifest `digest` into the OCI layout `layout` (tag "latest"), its
        blobs into the shared blob dir, layers byte for byte (no recompression)."""
        async with self._session(source, credentials) as (tmp, auth):
            argv = [*self._global_args(tmp), "copy", "--quiet=false",
                    f"--src-tls-verify={'true' if source.tls_verify else 'false'}",
                    "--retry-times", str(self.config.retries),
                    "--dest-shared-blob-dir", str(self.config.blobs_dir),
                    "--dest-oci-accept-uncompressed-layers", "--remove-signatures"]
            argv += ["--src-authfile", str(auth)] if auth else ["--src-no-creds"]
            argv += [source.docker_ref(digest), f"oci:{layout}:latest"]

            def line(text: str) -> None:
                parsed = parse_copy_line(text)
                if parsed is not None and on_line is not None:
                    on_line(parsed)

            rc, _, err = await _run(argv, self._env(tmp), on_line=line)
        if rc != 0:
            raise classify(err, reference=reference, source=source,
                           with_credentials=credentials is not None,
                           hub_without_mirror=hub_without_mirror)


async def _run(argv: list[str], env: dict[str, str],
               on_line: Callable[[str], None] | None) -> tuple[int, bytes, str]:
    """Run argv in its own session; stdout lines go to `on_line` (else are returned).
    Cancellation kills the whole process group and reaps it."""
    proc = await asyncio.create_subprocess_exec(
        *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    stdout, stderr = proc.stdout, proc.stderr
    if stdout is None or stderr is None:
        raise RuntimeError("skopeo started without pipes")
    out = bytearray()

    async def read_out() -> None:
        if on_line is None:
            out.extend(await stdout.read())
            return
        async for raw in stdout:
            on_line(raw.decode(errors="replace"))

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(read_out())
            err_task = tg.create_task(stderr.read())
        rc = await proc.wait()
    except BaseException:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with suppress(ProcessLookupError):
            await asyncio.shield(proc.wait())
        raise
    return rc, bytes(out), err_task.result().decode(errors="replace")
