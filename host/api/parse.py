"""Turn HTTP bodies and query strings into the orchestrator's frozen values.

Every check raises `ApiError(400, <what is wrong, naming the field>)`; nothing here lets a
malformed body become a 500.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any
from urllib.parse import unquote

from starlette.requests import Request

from host.orchestrator.model import CreateRequest, NetworkConfig
from host.orchestrator.states import SandboxState

from .errors import bad_request

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_FORKS = 16          # one node restores at most 16 children (DESIGN.md "Fork")
MAX_LIST_LIMIT = 100


async def json_body(request: Request, *, required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is `{}` unless `required`."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise bad_request("request body is required")
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def opt_int(body: dict[str, Any], key: str, *, lo: int = 0, hi: int = INT32_MAX,
            default: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {_type_name(value)}")
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' must be between {lo} and {hi}, got {value}")
    return value


def req_int(body: dict[str, Any], key: str, *, lo: int = 0, hi: int = INT32_MAX) -> int:
    value = opt_int(body, key, lo=lo, hi=hi)
    if value is None:
        raise bad_request(f"'{key}' is required")
    return value


def opt_bool(body: dict[str, Any], key: str, default: bool | None = None) -> bool | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {_type_name(value)}")
    return value


def opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {_type_name(value)}")
    return value


def opt_object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{key}' must be an object, got {_type_name(value)}")
    return value


def str_map(body: dict[str, Any], key: str) -> dict[str, str]:
    value = opt_object(body, key)
    for k, v in value.items():
        if not isinstance(v, str):
            raise bad_request(f"'{key}.{k}' must be a string, got {_type_name(v)}")
    return dict(value)


def str_list(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(f"'{key}' must be an array of strings")
    return tuple(value)


# --- request bodies -------------------------------------------------------------------

_NETWORK_KNOWN = ("allowPublicTraffic", "allowOut", "denyOut", "maskRequestHost")


def network_config(body: dict[str, Any], *, allow_internet_access: bool | None,
                   base: NetworkConfig | None = None) -> NetworkConfig:
    """`SandboxNetworkConfig` (create) or `SandboxNetworkUpdateConfig` (PUT, with `base`)."""
    base = base or NetworkConfig()
    # accepted and kept, not enforced; type-checked so nothing malformed is stored
    opt_object(body, "rules")
    opt_object(body, "egressProxy")
    str_list(body, "dnsServers")
    ports = body.get("httpsPorts")
    if ports is not None and not (isinstance(ports, list) and all(
            isinstance(p, int) and not isinstance(p, bool) for p in ports)):
        raise bad_request("'httpsPorts' must be an array of integers")
    extra = {k: v for k, v in body.items() if k not in _NETWORK_KNOWN and v is not None}
    public = opt_bool(body, "allowPublicTraffic", base.allow_public_traffic)
    deny = str_list(body, "denyOut")
    if allow_internet_access is False and "0.0.0.0/0" not in deny:
        deny = (*deny, "0.0.0.0/0")  # spec: allow_internet_access=false == denyOut 0.0.0.0/0
    return NetworkConfig(
        allow_internet_access=True if allow_internet_access is None else allow_internet_access,
        allow_public_traffic=bool(public),
        allow_out=str_list(body, "allowOut"),
        deny_out=deny,
        mask_request_host=opt_str(body, "maskRequestHost") or base.mask_request_host,
        extra=extra,
    )


def create_request(body: dict[str, Any], *, legacy: bool,
                   idempotency_key: str | None = None) -> CreateRequest:
    """`NewSandboxV2` (or legacy `NewSandbox` with `secure`) -> CreateRequest."""
    template = opt_str(body, "templateID")
    if not template:
        raise bad_request("'templateID' is required")
    mounts = body.get("volumeMounts")
    if mounts not in (None, []):
        raise bad_request("'volumeMounts' are not supported by this server")
    auto_resume = opt_object(body, "autoResume")
    if body.get("autoResume") is not None and not isinstance(auto_resume.get("enabled"), bool):
        raise bad_request("'autoResume.enabled' is required and must be a boolean")
    opt_object(body, "mcp")   # accepted, not used
    opt_object(body, "iam")   # accepted, not used
    kwargs: dict[str, Any] = {}
    if (auto_pause := opt_bool(body, "autoPause")) is not None:
        kwargs["auto_pause"] = auto_pause
    if (auto_pause_memory := opt_bool(body, "autoPauseMemory")) is not None:
        kwargs["auto_pause_memory"] = auto_pause_memory
    return CreateRequest(
        template_id=template,
        timeout_s=opt_int(body, "timeout", default=300) or 0,
        auto_resume=bool(opt_bool(auto_resume, "enabled", False)),
        metadata=str_map(body, "metadata"),
        env_vars=str_map(body, "envVars"),
        network=network_config(opt_object(body, "network"),
                               allow_internet_access=opt_bool(body, "allow_internet_access")),
        # v2 sandboxes are always secured; legacy v1 only when asked (1.x default: insecure)
        secure=bool(opt_bool(body, "secure", False)) if legacy else True,
        idempotency_key=idempotency_key,
        **kwargs,
    )


def fork_params(body: dict[str, Any]) -> tuple[int, int | None]:
    count = body.get("count")
    if count is None:
        count = 1
    if isinstance(count, bool) or not isinstance(count, int):
        raise bad_request(f"'count' must be an integer, got {_type_name(count)}")
    if not 1 <= count <= MAX_FORKS:
        raise bad_request(f"'count' must be between 1 and {MAX_FORKS} "
                          f"(at most {MAX_FORKS} forks per call on one node), got {count}")
    return count, opt_int(body, "timeout")


# --- query strings --------------------------------------------------------------------

_PUBLIC_STATES = {"running", "paused"}


def states_filter(raw: str | None) -> frozenset[SandboxState] | None:
    """`state=running,paused` -> internal states whose public face is one of those."""
    if raw is None or not raw.strip():
        return None
    wanted = {s.strip() for s in raw.split(",") if s.strip()}
    if bad := wanted - _PUBLIC_STATES:
        raise bad_request(f"invalid state filter {sorted(bad)}; allowed: running, paused")
    gone = {SandboxState.KILLING, SandboxState.KILLED}
    return frozenset(s for s in SandboxState if s.public in wanted and s not in gone)


def metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the double-encoded `metadata` param exactly like upstream `parseFilters`.

    (1) normal query decoding already happened; (2) unquote the whole string; (3) split on
    `&` and `=`; (4) unquote each key and value.
    """
    if not raw:
        return {}
    out: dict[str, str] = {}
    for pair in unquote(raw).split("&"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise bad_request(f"invalid metadata filter {pair!r}; expected key=value")
        out[unquote(key)] = unquote(value)
    return out


def rfc3339(raw: str | None, name: str) -> float | None:
    if raw is None:
        return None
    try:
        dt = datetime.fromisoformat(raw.replace("z", "Z"))
    except ValueError as exc:
        raise bad_request(f"'{name}' must be an RFC 3339 date-time, got {raw!r}") from exc
    if dt.tzinfo is None:
        raise bad_request(f"'{name}' must carry a time zone offset, got {raw!r}")
    return dt.timestamp()


def query_int(raw: str | None, name: str, *, lo: int, hi: int, default: int) -> int:
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise bad_request(f"'{name}' must be an integer, got {raw!r}") from exc
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}")
    return value


def order(raw: str | None) -> bool:
    """True for descending (the default)."""
    if raw is None or raw == "" or raw == "desc":
        return True
    if raw == "asc":
        return False
    raise bad_request(f"'order' must be 'asc' or 'desc', got {raw!r}")


# --- opaque cursors -------------------------------------------------------------------

def encode_cursor(sort_key: float, ident: str) -> str:
    raw = json.dumps([sort_key, ident], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(token: str | None) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        key, ident = json.loads(raw)
        if isinstance(key, bool) or not isinstance(key, (int, float)) or not isinstance(ident, str):
            raise TypeError("bad cursor shape")
    except (binascii.Error, ValueError, TypeError) as exc:
        raise bad_request("invalid 'nextToken'") from exc
    return float(key), ident
