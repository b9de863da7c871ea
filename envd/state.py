"""Mutable sandbox-wide defaults, set at start-up and by the host's POST /init."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import EnvdConfig


@dataclass
class Defaults:
    """What `/init` controls: access token, env vars, default user and workdir.

    One instance lives in the Starlette app state; services receive it explicitly.
    """

    user: str
    workdir: str | None = None
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: EnvdConfig) -> Defaults:
        return cls(user=config.default_user, workdir=config.default_workdir)
