"""The server's settings, read once from the environment and passed down explicitly."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .languages import WARM_LANGUAGES, normalize_language

DEFAULT_PORT = 49999  # the port the e2b code-interpreter SDKs call (JUPYTER_PORT)
DEFAULT_ENVD_URL = "http://127.0.0.1:49983"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Where to listen, where kernels start, where envd is, and the server's timings.

    Environment: AENV_CI_HOST, AENV_CI_PORT, AENV_CI_CWD (default working directory of
    contexts; the server's own cwd when that directory is missing), AENV_CI_ENVD_URL,
    AENV_CI_KEEPALIVE_S, AENV_CI_WARM (comma-separated languages whose default context's
    kernel starts with the server; python).
    """

    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    default_cwd: str = "/home/user"
    envd_url: str = DEFAULT_ENVD_URL
    envd_timeout_s: float = 2.0
    kernel_ready_timeout_s: float = 120.0
    # how often an execution waiting on a quiet kernel checks that the kernel is alive
    # and whether its client went away (then it interrupts the kernel)
    poll_interval_s: float = 0.2
    # a cancelled execution that is still running this long after an interrupt gets another
    interrupt_retry_s: float = 2.0
    # a line of {"type": "keepalive"} after this much silence: E2B's server sends them too,
    # and they keep idle-timeout proxies between the SDK and the sandbox from cutting a
    # long quiet execution
    keepalive_s: float = 5.0
    reply_timeout_s: float = 10.0
    # the longest wait for a flush cell's markers (languages.Language.flush)
    flush_timeout_s: float = 30.0
    warm_languages: tuple[str, ...] = WARM_LANGUAGES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        cwd = env.get("AENV_CI_CWD", "/home/user")
        if not os.path.isdir(cwd):
            cwd = os.getcwd()
        try:
            port = int(env.get("AENV_CI_PORT", str(DEFAULT_PORT)))
            keepalive_s = float(env.get("AENV_CI_KEEPALIVE_S", "5"))
        except ValueError as exc:
            raise SystemExit(f"bad AENV_CI_PORT / AENV_CI_KEEPALIVE_S: {exc}") from exc
        if keepalive_s <= 0:
            raise SystemExit("AENV_CI_KEEPALIVE_S must be positive")
        try:
            warm = tuple(dict.fromkeys(
                normalize_language(name) for name in
                env.get("AENV_CI_WARM", ",".join(WARM_LANGUAGES)).split(",") if name.strip()))
        except ValueError as exc:
            raise SystemExit(f"bad AENV_CI_WARM: {exc}") from exc
        return cls(host=env.get("AENV_CI_HOST", "0.0.0.0"), port=port, default_cwd=cwd,
                   envd_url=env.get("AENV_CI_ENVD_URL", DEFAULT_ENVD_URL).rstrip("/"),
                   keepalive_s=keepalive_s, warm_languages=warm)
