"""Which sandbox port a request is for (spec §1.6.1, mirror of infra `GetTargetFromRequest`).

    host = localhost | IP literal | sandbox.<domain>  -> E2b-Sandbox-Id + E2b-Sandbox-Port
    host = <port>-<sandboxID>.<anything>              -> parsed from the left-most label
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from host.ids import is_routable_id
from host.orchestrator.model import Route

ENVD_PORT = 49983
MASK_PORT_PLACEHOLDER = "${PORT}"  # in network.maskRequestHost: the sandbox port
CODE_INTERPRETER_PORT = 49999   # e2b_code_interpreter's server (spec §1.4)


class BadTarget(ValueError):
    """The request names no valid sandbox port (-> 400)."""


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def host_name(host_header: str) -> str:
    """`Host` without the port, lower-cased; IPv6 brackets removed."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise BadTarget(f"invalid sandbox port '{raw}'")
    return int(raw)


def _sandbox_id(raw: str) -> str:
    # any id a DNS label can carry (host/ids.py ROUTABLE_ID): one that is not ours is
    # "not found" (502), not "invalid" (400), as on E2B
    if not is_routable_id(raw):
        raise BadTarget(f"invalid sandbox id '{raw}'")
    return raw


def routes_by_headers(host: str, domain: str | None) -> bool:
    return host == "localhost" or _is_ip(host) or (domain is not None and host == f"sandbox.{domain}")


def parse_target(host: str, sandbox_id_header: str | None, port_header: str | None,
                 domain: str | None) -> Target:
    """Resolve the target of one request; raises `BadTarget` with a message for the 400."""
    if routes_by_headers(host, domain):
        if sandbox_id_header is None:
            raise BadTarget("missing header E2b-Sandbox-Id")
        if port_header is None:
            raise BadTarget("missing header E2b-Sandbox-Port")
        return Target(_sandbox_id(sandbox_id_header.strip()), _port(port_header.strip()))
    if "." not in host:
        raise BadTarget(f"Invalid host '{host}'")
    parts = host.split(".", 1)[0].split("-")
    if len(parts) < 2:
        raise BadTarget(f"Invalid host '{host}': expected <port>-<sandboxID>.<domain>")
    return Target(_sandbox_id(parts[1]), _port(parts[0]))


def masked_host(route: Route, target: Target) -> str | None:
    """The Host a user port sees when the sandbox has network.maskRequestHost (as E2B:
    `${PORT}` is the sandbox port; envd's port is never masked); None: the client's."""
    if route.mask_request_host is None or target.port == ENVD_PORT:
        return None
    return route.mask_request_host.replace(MASK_PORT_PLACEHOLDER, str(target.port))
