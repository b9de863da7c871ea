"""The host's calls into a sandbox's envd: `POST /init`, `GET /metrics`, `sync` (a
root `/bin/sync` through envd's process API before a filesystem-only pause), and
`reclaim` (aenv's envd drops the guest's clean page cache before a memory snapshot).

One httpx client per orchestrator (no kept-alive connections); tests inject an
`httpx.MockTransport`. envd runs inside the guest and may be hostile: every answer is read
through host/guestio.py, at most its call's limit, and one past it fails the call with
`GuestAnswerInvalid` (502).

Every /init carries fresh host entropy (`aenvEntropy`, our field: E2B's envd ignores
unknown fields): a sandbox restored from a snapshot resumes the snapshot's kernel RNG
state, and aenv's envd reseeds the kernel RNG from these bytes first thing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from typing import Any

import httpx

from host import guestio
from host.connect_envelope import END_STREAM, envelope
from host.contract import GuestDefaults, Placement

from .errors import GuestAnswerInvalid, OperationFailed
from .model import Metric

log = logging.getLogger(__name__)

ENVD_PORT = 49983
DEFAULT_USER = "user"
DEFAULT_WORKDIR = "/home/user"


class EnvdClient:
    """Talks to envd at a placement's address (host-internal, not through the proxy)."""

    def __init__(self, *, transport: httpx.AsyncBaseTransport | None = None,
                 timeout_s: float = 10.0, init_timeout_s: float = 30.0,
                 init_attempts: int = 4) -> None:
        # No keep-alive: these calls are few per sandbox run (init, health, sync,
        # metrics), and a kept connection outlives the run it went to (issue 14 item 21:
        # two sockets per ended sandbox, for ever)
        self._http = httpx.AsyncClient(transport=transport, timeout=timeout_s, trust_env=False,
                                       limits=httpx.Limits(max_keepalive_connections=0))
        self._init_timeout_s = init_timeout_s
        self._init_attempts = init_attempts

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _url(placement: Placement, path: str) -> str:
        host, port = placement.address(ENVD_PORT)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{port}{path}"

    async def init(self, placement: Placement, *, token: str | None, current_token: str | None,
                   env_vars: dict[str, str], guest: GuestDefaults | None = None,
                   volume_mounts: list[dict[str, str]] | None = None) -> None:
        """Reseed the guest's kernel RNG; install the access token, env vars, default
        user/workdir and the clock.

        `current_token` is the token envd already holds (restored from a snapshot taken
        after an earlier /init): envd requires it on a re-init. `guest`: a built
        template's defaults (its USER, WORKDIR and ENV); the sandbox's own `env_vars`
        win over the template's. `volume_mounts`: the volumes envd mounts (name, path,
        address of the host's volume server: mounts.py), where not mounted yet.
        """
        body: dict[str, Any] = {
            "envVars": {**guest.env, **env_vars} if guest else env_vars,
            "defaultUser": guest.user if guest else DEFAULT_USER,
            "defaultWorkdir": guest.workdir if guest else DEFAULT_WORKDIR,
            # entropy new for every start: siblings restored from one snapshot must diverge
            **guestio.clock_and_entropy(),
        }
        if token:
            body["accessToken"] = token
        if volume_mounts:
            body["aenvVolumeMounts"] = volume_mounts
        headers = {"X-Access-Token": current_token} if current_token else {}
        last: Exception | None = None
        for attempt in range(self._init_attempts):
            try:
                resp = await guestio.request(
                    self._http, "POST", self._url(placement, "/init"),
                    limit=guestio.MAX_ANSWER_BYTES, what="/init", json=body,
                    headers=headers, timeout=self._init_timeout_s)
            except httpx.HTTPError as exc:  # envd answered /health already: retry briefly
                last = exc
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            except guestio.GuestAnswerError as exc:  # it answered, wrongly: no retry
                raise _invalid(placement, exc) from exc
            if resp.status_code == 401 and attempt > 0 and token and headers.get(
                    "X-Access-Token") != token:
                # An earlier attempt timed out after envd applied it: the new token holds.
                headers = {"X-Access-Token": token}
                continue
            if resp.status_code >= 300:
                raise OperationFailed(
                    f"envd /init of {placement.sandbox_id} answered {resp.status_code}: "
                    f"{resp.text[:200]}")
            return
        raise OperationFailed(f"envd /init of {placement.sandbox_id} failed: {last}") from last

    async def sync(self, placement: Placement, token: str | None, *,
                   timeout_s: float = 30.0) -> None:
        """Flush the guest's page cache to its disk: `/bin/sync` as root through the
        Connect `process.Process/Start` stream (any E2B envd serves it; no guest agent
        needed). One JSON request envelope; the response stream ends with an end-of-stream
        envelope carrying an error, if any."""
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                   "Connect-Timeout-Ms": str(int(timeout_s * 1000)),
                   "Authorization": "Basic " + base64.b64encode(b"root:").decode()}
        if token:
            headers["X-Access-Token"] = token
        path = "/process.Process/Start"
        end: dict[str, Any] = {}
        done: Any = None
        try:
            async with guestio.stream(
                    self._http, "POST", self._url(placement, path),
                    content=envelope({"process": {"cmd": "/bin/sync", "args": []}}),
                    headers=headers, timeout=timeout_s) as resp:
                if resp.status_code != 200:
                    body = await guestio.read_body(resp, limit=guestio.MAX_ANSWER_BYTES,
                                                   what=path)
                    raise OperationFailed(f"sync in {placement.sandbox_id}: envd answered "
                                          f"{resp.status_code}: {body[:200]!r}")
                # only the end events are kept: a /bin/sync that prints stays flat here
                async with contextlib.aclosing(guestio.aiter_messages(
                        resp, what=path,
                        max_total_bytes=guestio.MAX_SYNC_STREAM_BYTES)) as frames:
                    async for flags, m in frames:
                        event = m.get("event")
                        if flags & END_STREAM:
                            end = m
                        elif done is None and isinstance(event, dict) and "end" in event:
                            done = event["end"]
        except httpx.HTTPError as exc:
            raise OperationFailed(f"sync in {placement.sandbox_id} failed: {exc}") from exc
        except guestio.GuestAnswerError as exc:
            raise _invalid(placement, exc) from exc
        if end.get("error"):
            raise OperationFailed(f"sync in {placement.sandbox_id} failed: {end['error']}")
        # what /bin/sync itself said: a filesystem pause keeps only what reached the disk
        # (issue 14 item 18), so a sync that failed (an I/O error) must stop it
        if not isinstance(done, dict):
            raise OperationFailed(f"sync in {placement.sandbox_id}: the stream ended before "
                                  "the process did")
        if done.get("exitCode", 0) != 0 or not done.get("exited", True):
            raise OperationFailed(f"sync in {placement.sandbox_id} failed: "
                                  f"{done.get('status') or done.get('error') or done}")

    async def reclaim(self, placement: Placement, token: str | None, *,
                      timeout_s: float = 10.0) -> int:
        """Ask the guest to drop its clean page cache before its memory is snapshotted
        (`POST /aenv/reclaim`, envd/http/reclaim.py); the MiB it says it freed. 0 when
        its envd has no such route (E2B's, or an older aenv envd in a template) or the
        call failed: the snapshot goes on without it, only larger."""
        headers = {"X-Access-Token": token} if token else {}
        path = "/aenv/reclaim"
        try:
            resp = await guestio.request(self._http, "POST", self._url(placement, path),
                                         limit=guestio.MAX_ANSWER_BYTES, what=path,
                                         headers=headers, timeout=timeout_s)
            if resp.status_code == 404:
                return 0
            if not 200 <= resp.status_code < 300:
                raise OperationFailed(f"envd answered {resp.status_code}: {resp.text[:200]}")
            freed = resp.json()["freedMiB"]
            if not isinstance(freed, int) or isinstance(freed, bool):
                raise OperationFailed(f"freedMiB is not a number: {freed!r}")
        except (httpx.HTTPError, guestio.GuestAnswerError, OperationFailed, ValueError,
                TypeError, KeyError) as exc:
            log.warning("sandbox %s: its page cache was not dropped before the snapshot "
                        "(%s): the snapshot keeps it", placement.sandbox_id, exc)
            return 0
        return max(0, freed)

    async def healthy(self, placement: Placement, *, attempts: int = 3,
                      timeout_s: float = 3.0) -> bool:
        """envd answers GET /health (used after adopting a VM whose vCPUs may have been
        stopped by a snapshot that never finished)."""
        for attempt in range(attempts):
            try:
                resp = await guestio.request(
                    self._http, "GET", self._url(placement, "/health"),
                    limit=guestio.MAX_ANSWER_BYTES, what="/health", timeout=timeout_s)
                if resp.status_code < 300:
                    return True
            except httpx.HTTPError:
                pass
            except guestio.GuestAnswerError as exc:
                # an envd that answers so is not one to rely on; asking again costs
                # another read of the limit
                log.warning("sandbox %s: %s; counted as not healthy", placement.sandbox_id,
                            exc)
                return False
            await asyncio.sleep(0.3 * (attempt + 1))
        return False

    async def metrics(self, placement: Placement, token: str | None) -> Metric:
        headers = {"X-Access-Token": token} if token else {}
        try:
            resp = await guestio.request(self._http, "GET", self._url(placement, "/metrics"),
                                         limit=guestio.MAX_METRICS_BYTES, what="/metrics",
                                         headers=headers)
        except httpx.HTTPError as exc:
            raise OperationFailed(f"envd /metrics of {placement.sandbox_id} failed: {exc}") from exc
        except guestio.GuestAnswerError as exc:
            raise _invalid(placement, exc) from exc
        if not 200 <= resp.status_code < 300:
            raise OperationFailed(f"envd /metrics of {placement.sandbox_id} answered "
                                  f"{resp.status_code}: {resp.text[:200]}")
        try:
            m = resp.json()
            return Metric(timestamp=float(m.get("ts", 0)), cpu_count=int(m.get("cpu_count", 0)),
                          cpu_used_pct=float(m.get("cpu_used_pct", 0.0)),
                          mem_used=int(m.get("mem_used", 0)),
                          mem_total=int(m.get("mem_total", 0)),
                          mem_cache=int(m.get("mem_cache", 0)),
                          disk_used=int(m.get("disk_used", 0)),
                          disk_total=int(m.get("disk_total", 0)))
        # not JSON, not an object, or fields that are not numbers
        except (ValueError, TypeError, AttributeError) as exc:
            raise GuestAnswerInvalid(f"sandbox '{placement.sandbox_id}': envd answered "
                                     f"/metrics with something else than metrics: {exc}") \
                from exc


def _invalid(placement: Placement, exc: guestio.GuestAnswerError) -> GuestAnswerInvalid:
    return GuestAnswerInvalid(f"sandbox '{placement.sandbox_id}': {exc}")
