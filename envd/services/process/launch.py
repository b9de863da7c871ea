"""Turn a StartRequest plus the caller's user and sandbox defaults into a SpawnSpec."""

from __future__ import annotations

import os

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ...spec.process.process_pb import ProcessConfig, StartRequest
from ...state import Defaults
from ...users import User
from .proc import SpawnSpec

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PTY_SIZE = (80, 24)


def process_env(user: User, defaults: Defaults, request_envs: dict[str, str]) -> dict[str, str]:
    """PATH/HOME/USER/LOGNAME, then the sandbox env vars (/init), then the request's."""
    env = {"PATH": DEFAULT_PATH, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    env.update(defaults.env_vars)
    env.update(request_envs)
    return env


def resolve_cwd(requested: str | None, user: User, defaults: Defaults) -> str:
    """The working directory: requested (`~`/relative → user's home), else workdir, else home."""
    if requested:
        if requested == "~" or requested.startswith("~/"):
            path = user.home + requested[1:]
        elif not os.path.isabs(requested):
            path = os.path.join(user.home, requested)
        else:
            path = requested
        path = os.path.normpath(path)
        if not os.path.isdir(path):
            raise ConnectError(Code.INVALID_ARGUMENT,
                               f"invalid cwd '{requested}': not an existing directory")
        return path
    for candidate in (defaults.workdir, user.home):
        if candidate and os.path.isdir(candidate):
            return candidate
    return "/"


def program(cmd: str) -> str:
    """The program to run for `cmd`. The SDKs start every command as `/bin/bash -l -c`
    (and PTYs as `/bin/bash -i -l`); an image without bash (busybox, alpine) still has a
    POSIX shell that takes those flags, so `/bin/bash` falls back to `/bin/sh` there."""
    if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
        return "/bin/sh"
    return cmd


def spawn_spec(request: StartRequest, user: User, defaults: Defaults) -> SpawnSpec:
    config: ProcessConfig | None = request.process
    if config is None or not config.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
    cwd = resolve_cwd(config.cwd if config.has_field("cwd") else None, user, defaults)
    pty_size = None
    if request.has_field("pty"):
        size = request.pty.size if request.pty is not None else None
        cols = (size.cols if size is not None else 0) or DEFAULT_PTY_SIZE[0]
        rows = (size.rows if size is not None else 0) or DEFAULT_PTY_SIZE[1]
        pty_size = (cols, rows)
    return SpawnSpec(
        argv=[program(config.cmd), *config.args],
        env=process_env(user, defaults, dict(config.envs)),
        cwd=cwd,
        user=user,
        stdin=request.stdin if request.has_field("stdin") else True,
        pty_size=pty_size,
        tag=request.tag if request.has_field("tag") else None,
        meta=config,
    )


__all__ = ["process_env", "program", "resolve_cwd", "spawn_spec"]
