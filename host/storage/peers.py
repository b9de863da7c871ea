"""Layer bytes from neighbouring nodes before the repository (a cluster node's `--p2p`).

The block server reads remote layers chunk by chunk through its cache (cache.py), each
chunk with `Repository.read_layer`. With `--peers-file`, `PeerLayers` wraps the repository
and asks first the neighbours that hold the layer: the file, kept by the host service
(host/cluster/peers.py) and re-read when it changes, lists them:

    {"key": "<node key>", "peers": [{"node": "n2", "address": "http://10.0.0.12:3000",
                                     "layers": ["<sha256 hex>", ...]}, ...]}

A neighbour answers `GET /cluster/layers/<hex>?offset=O&length=L` from its own sealed
layer file or from its chunk cache (`held_range`), 404 otherwise. Its bytes are kept only
when they match the layer's chunk sums; without sums (layers uploaded before they were
recorded), or on any failure, the repository is read as before.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import httpx

from .errors import IntegrityError
from .repository import Repository, digest_hex

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
_TOLD_MAX = 4096  # (layer, neighbour) pairs whose first read was logged


class PeerLayers:
    """A `Repository` whose `read_layer` tries the neighbours first; everything else is
    the wrapped repository's."""

    def __init__(self, inner: Repository, peers_file: Path, *,
                 client: httpx.Client | None = None) -> None:
        self.inner = inner
        self.peers_file = peers_file
        self.client = client or httpx.Client(timeout=TIMEOUT_S)
        self.peer_bytes = 0     # layer bytes neighbours served (the stats' `peer` bytes)
        self._lock = threading.Lock()
        self._seen: tuple[float, int] | None = None
        self._doc: dict[str, Any] = {}
        self._told: set[tuple[str, str]] = set()   # (layer, node) logged once

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _peers(self) -> tuple[str, list[dict[str, Any]]]:
        try:
            st = self.peers_file.stat()
        except FileNotFoundError:
            return "", []
        with self._lock:
            if self._seen != (st.st_mtime, st.st_size):
                try:
                    self._doc = json.loads(self.peers_file.read_text())
                    self._seen = (st.st_mtime, st.st_size)
                except (OSError, ValueError) as exc:
                    log.warning("peers file %s unreadable: %s", self.peers_file, exc)
                    return "", []
            return str(self._doc.get("key", "")), list(self._doc.get("peers", []))

    def read_layer(self, digest: str, offset: int, length: int) -> bytes:
        hexd = digest_hex(digest)
        key, peers = self._peers()
        holders = [p for p in peers if hexd in p.get("layers", ())]
        sums = self.inner.layer_sums(digest) if holders else None
        if sums is None:   # nothing to check a neighbour's bytes against
            holders = []
        for peer in holders:
            assert sums is not None
            data = self._ask(peer, key, hexd, offset, length)
            if data is None:
                continue
            try:
                sums.check(offset, data)
            except IntegrityError as exc:
                log.warning("neighbour %s sent damaged bytes of %s: %s", peer.get("node"),
                            digest, exc)
                continue
            with self._lock:
                self.peer_bytes += len(data)
                first = (hexd, str(peer.get("node"))) not in self._told
                if len(self._told) >= _TOLD_MAX:  # months of layers: say one again, not grow
                    self._told.clear()
                self._told.add((hexd, str(peer.get("node"))))
            if first:
                log.info("layer %s: reading chunks from neighbour %s", digest, peer.get("node"))
            return data
        return self.inner.read_layer(digest, offset, length)

    def _ask(self, peer: dict[str, Any], key: str, hexd: str, offset: int,
             length: int) -> bytes | None:
        url = f"{str(peer.get('address', '')).rstrip('/')}/cluster/layers/{hexd}"
        try:
            resp = self.client.get(url, params={"offset": offset, "length": length},
                                   headers={"X-API-Key": key})
        except httpx.HTTPError as exc:
            log.info("neighbour %s: %s", peer.get("node"), exc)
            return None
        if resp.status_code != 200 or len(resp.content) != length:
            return None
        return resp.content


def held_layers(layers_dir: Path, cache_dir: Path | None) -> set[str]:
    """The layers (sha256 hex) this node can serve any bytes of: its sealed layer files
    and the layers its chunk cache holds chunks of."""
    out = {p.name.removesuffix(".lsmt") for p in _listing(layers_dir)
           if p.name.endswith(".lsmt")}
    if cache_dir is not None:
        out |= {p.name for p in _listing(cache_dir) if p.is_dir() and len(p.name) == 64}
    return out


def held_range(layers_dir: Path, cache_dir: Path | None, hexd: str, offset: int,
               length: int, *, chunk_size: int) -> bytes | None:
    """`length` bytes at `offset` of layer `hexd` from this node's sealed layer file, or
    the one cached chunk they are exactly; None when this node has not got them."""
    try:
        digest_hex(f"sha256:{hexd}")   # a digest's hex, nothing a path could climb out with
    except ValueError:
        return None
    if length <= 0:
        return None
    try:
        with open(layers_dir / f"{hexd}.lsmt", "rb") as f:
            data = os.pread(f.fileno(), length, offset)
        return data if len(data) == length else None
    except FileNotFoundError:
        pass
    if cache_dir is None or offset % chunk_size:
        return None
    try:
        data = (cache_dir / hexd / str(offset // chunk_size)).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return data if len(data) == length else None


def _listing(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
