"""The credentials `aenv auth login` saves: API URL, API key and sandbox proxy URL in
`$XDG_CONFIG_HOME/aenv/credentials` (default `~/.config/aenv/credentials`), one JSON
object. The file is created with mode 0600 (its directory 0700) and replaced atomically:
a reader sees the old file or the new one, never a part, and the key is never readable by
others, not even for a moment."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import CredentialsError

FILE_MODE = 0o600
DIR_MODE = 0o700


@dataclass(frozen=True)
class Credentials:
    api_url: str
    api_key: str
    sandbox_url: str


def credentials_path() -> Path:
    """Where the credentials live: `$XDG_CONFIG_HOME/aenv/credentials`."""
    config = os.environ.get("XDG_CONFIG_HOME") or ""
    base = Path(config) if os.path.isabs(config) else Path.home() / ".config"
    return base / "aenv" / "credentials"


def load(path: Path | None = None) -> Credentials | None:
    """The saved credentials; None when there are none (no file)."""
    path = path or credentials_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CredentialsError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
        creds = Credentials(api_url=data["api_url"], api_key=data["api_key"],
                            sandbox_url=data["sandbox_url"])
    except (ValueError, TypeError, KeyError) as exc:
        raise CredentialsError(f"{path} is not an aenv credentials file") from exc
    if not all(isinstance(v, str) and v for v in asdict(creds).values()):
        raise CredentialsError(f"{path} is not an aenv credentials file")
    return creds


def save(creds: Credentials, path: Path | None = None) -> Path:
    """Write `creds` atomically: a 0600 temp file beside the target, renamed over it."""
    path = path or credentials_path()
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path.parent, DIR_MODE)  # an existing aenv/ directory too: it holds a key
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        # 0600 from creation (O_EXCL: never through someone else's file or link)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(asdict(creds), f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    except OSError as exc:
        raise CredentialsError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def remove(path: Path | None = None) -> bool:
    """Delete the credentials file; False when there was none."""
    path = path or credentials_path()
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CredentialsError(f"cannot remove {path}: {exc.strerror or exc}") from exc
    return True
