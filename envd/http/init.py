"""POST /init: the host installs token, env vars, default user/workdir and clock.

Called by the host after boot and again after resume/fork (with a new token): once
a token is set, a re-init must carry the current one as X-Access-Token. Setting the
clock is opt-in (`ENVD_SET_CLOCK=1`, set by the guest init) and needs root: envd
must never move the clock of a developer's machine or CI host. aenv's host also sends
fresh entropy (`aenvEntropy`): it reseeds the kernel RNG before anything else (entropy.py),
and the volumes to mount (`aenvVolumeMounts`: name, path, the host's volume server;
envd/volumes), mounted last, again only where missing.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import time
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..auth import require_token
from ..entropy import entropy_from, reseed_kernel_rng
from ..state import Defaults
from ..users import UnknownUserError, User
from ..volumes.mounts import MountError, Mounts
from ..volumes.mounts import parse as parse_mounts
from .errors import Endpoint, HTTPError, json_errors

log = logging.getLogger(__name__)

CLOCK_REALTIME = 0
CLOCK_SKEW_TOLERANCE_S = 1.0
SET_CLOCK_ENV = "ENVD_SET_CLOCK"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def clock_setting_enabled() -> bool:
    return os.environ.get(SET_CLOCK_ENV) == "1" and os.geteuid() == 0


def maybe_set_clock(target: datetime) -> bool:
    """Step CLOCK_REALTIME to `target` if enabled and off by more than the tolerance."""
    wanted = target.timestamp()
    if not clock_setting_enabled() or abs(wanted - time.time()) <= CLOCK_SKEW_TOLERANCE_S:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    ts = _Timespec(int(wanted), int((wanted % 1) * 1e9))
    if libc.clock_settime(CLOCK_REALTIME, ctypes.byref(ts)) != 0:
        log.warning("clock_settime failed: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _parse(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise HTTPError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "body must be a JSON object")
    return data


def _str_field(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise HTTPError(400, f"'{key}' must be a string")
    return value


def init_endpoint(defaults: Defaults, mounts: Mounts) -> Endpoint:
    @json_errors
    async def init(request: Request) -> Response:
        require_token(defaults, request.headers.get("x-access-token"))
        data = _parse(await request.body())
        # First, even if the rest of the body is refused: a restored guest draws from
        # its snapshot's RNG state until this runs. After the token check, so that only
        # the host can have envd (root) run RNG ioctls.
        entropy = entropy_from(data)
        if entropy is not None:
            await asyncio.to_thread(reseed_kernel_rng, entropy)

        env_vars = data.get("envVars")
        if env_vars is not None and not (
            isinstance(env_vars, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
        ):
            raise HTTPError(400, "'envVars' must map strings to strings")
        token = _str_field(data, "accessToken")
        user = _str_field(data, "defaultUser")
        workdir = _str_field(data, "defaultWorkdir")
        stamp = _str_field(data, "timestamp")
        when = None
        if stamp:
            try:
                when = datetime.fromisoformat(stamp)
            except ValueError:
                raise HTTPError(400, f"invalid timestamp '{stamp}'") from None
        if user:
            try:
                User.lookup(user)
            except UnknownUserError as exc:
                raise HTTPError(400, str(exc)) from None
        try:
            wanted = parse_mounts(data.get("aenvVolumeMounts") or [])
        except MountError as exc:
            raise HTTPError(400, str(exc)) from None

        # Validate everything first, then apply: a rejected /init changes nothing.
        if env_vars:
            defaults.env_vars.update(env_vars)
        if token:
            defaults.access_token = token
        if user:
            defaults.user = user
        if workdir:
            defaults.workdir = workdir
        if when is not None and when.tzinfo is not None:
            await asyncio.to_thread(maybe_set_clock, when)
        if wanted:
            try:
                await mounts.ensure(wanted)
            except (MountError, OSError) as exc:
                raise HTTPError(500, f"volume mounts: {exc}") from None
        return Response(status_code=204)

    return init
