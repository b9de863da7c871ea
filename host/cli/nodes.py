"""`aenv nodes [NODE_ID] [-o table|json]`: the nodes of a cluster, from the gateway's
GET /nodes (or one node, GET /nodes/{id}), with the API URL and key every command uses."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from .invocation import settings
from .output import echo_table, emit_json, output_option

HEADER = ("NODE", "STATE", "SANDBOXES", "VMS", "MEMORY MiB", "LOAD", "LAST HEARTBEAT",
          "ADDRESS")


def _row(n: dict[str, Any]) -> tuple[object, ...]:
    cap, used = n.get("capacity", {}), n.get("used", {})
    limit = cap.get("maxSandboxes") or 0
    vms = f"{used.get('sandboxes', 0)}/{limit}" if limit else str(used.get("sandboxes", 0))
    memory = f"{used.get('memoryMiB', 0)}/{cap.get('memoryMiB', 0)}"
    return (n.get("nodeID", ""), n.get("state", ""), n.get("sandboxes", 0), vms, memory,
            f"{float(used.get('load', 0.0)):.2f}", n.get("lastHeartbeat", ""),
            n.get("address", ""))


@click.command("nodes")
@click.argument("node_id", required=False)
@output_option
@click.pass_context
def nodes(ctx: click.Context, node_id: str | None, output: str) -> None:
    """List the cluster's nodes (through the gateway), or show one.

    VMS counts the sandboxes holding a VM (out of the node's limit, if it has one);
    SANDBOXES every sandbox bound to the node, paused and lost ones too."""
    api = settings(ctx).api
    path = f"/nodes/{quote(node_id, safe='')}" if node_id else "/nodes"
    data = api.request("GET", path).json()
    if output == "json":
        emit_json(data)
        return
    items = [data] if node_id else list(data)
    echo_table([HEADER, *(_row(n) for n in items)], style_column=1)
    if node_id and data.get("lostSandboxes"):
        click.echo(f"lost sandboxes: {' '.join(data['lostSandboxes'])}")
