"""The node's block server: one asyncio process exporting every stack over NBD.

    python -m host.storage.blockserver --socket-dir DIR --state-dir DIR [--repo SPEC]
        [--cache-dir DIR --cache-mib N]

Sockets: DIR/nbd.sock (all exports; the export name is the stack name; root's only),
DIR/x/<stack>/nbd.sock (that stack's export alone, for the VM that runs on it: the VM's jail
exposes this directory and nothing else of the block server, so a VMM cannot ask for
another sandbox's disk) and DIR/control.sock (JSON control API: controlserver.py, and
control.py's clients). The state dir (statedir.py) holds layers, uppers and stack manifests.

Layers are looked up locally first, then in the repository (openlayers.py): a posix_fs
repository is read in place, an oss one lazily through the chunk cache. The server recovers
every stack from its manifest at start (uppers replay their journals), including a seal cut
by a crash.
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import contextlib
import logging
import os
import re
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from host import heap

from .cache import ChunkCache
from .collect import Swept, sweep_layers
from .compact import write_merged
from .control import CONTROL_SOCKET, NBD_SOCKET, StackInfo, own_socket
from .controlserver import ControlServer
from .convert import write_raw
from .errors import LayerNotFoundError, StackExistsError, StackNotFoundError, StorageError
from .export import StackExport
from .index import SegmentIndex
from .lsmt import SealedLayer
from .nbd import NbdServer
from .openlayers import OpenLayers
from .peers import PeerLayers
from .repository import Repository, open_repository
from .stack import Stack, merge_layers
from .statedir import StateDir
from .upper import Upper

log = logging.getLogger(__name__)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BlockServer:
    """Owns the stacks, their layers, the NBD server and the control server."""

    def __init__(self, *, socket_dir: str | os.PathLike[str], state_dir: str | os.PathLike[str],
                 repository: Repository | None = None, cache: ChunkCache | None = None) -> None:
        self.socket_dir = Path(socket_dir)
        self.state = StateDir(state_dir)
        self.repository = repository
        self.cache = cache
        self.nbd_socket = self.socket_dir / NBD_SOCKET
        self.control_socket = self.socket_dir / CONTROL_SOCKET
        self.layers = OpenLayers(self.state, repository, cache)
        self._stacks: dict[str, StackExport] = {}
        self._ops_lock = asyncio.Lock()  # control operations run one at a time
        self._nbd = NbdServer(self.nbd_socket, self._stacks.get, lambda: sorted(self._stacks))
        self._own: dict[str, NbdServer] = {}  # stack -> the server of its own socket
        self._control = ControlServer(self.control_socket, {
            "list": self.list, "create": self.create, "seal": self.seal, "clone": self.clone,
            "delete": self.delete, "flush": self.flush, "info": self.info,
            "prehash": self.prehash, "import_layer": self.import_layer, "push": self.push,
            "export_raw": self.export_raw, "collect": self.collect, "compact": self.compact,
        }, {"ping": lambda: True, "stats": self.stats})

    async def _serve_own(self, name: str) -> None:
        """Listen on the stack's own socket. Its directory is kept across restarts (a
        jail binds the directory, so a restarted server's new socket is seen inside);
        the socket is 0666 inside a 0700 directory that the jail hands to the VM's uid."""
        path = own_socket(self.socket_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)

        def lookup(export: str) -> StackExport | None:
            return self._stacks.get(export) if export == name else None

        def names() -> builtins.list[str]:
            return [name] if name in self._stacks else []

        server = NbdServer(path, lookup, names)
        await server.start()
        os.chmod(path, 0o666)
        self._own[name] = server

    # --- lifecycle ---
    async def start(self) -> None:
        self.state.prepare()
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._recover)
        await self._nbd.start()
        for name in sorted(self._stacks):
            await self._serve_own(name)
        await self._control.start()

    async def aclose(self) -> None:
        """Stop accepting, drop NBD connections, flush and close every stack."""
        await self._control.aclose()
        await self._nbd.aclose()
        for server in self._own.values():
            await server.aclose()
        self._own.clear()
        for exp in self._stacks.values():
            await exp.aclose_prehash()
            with contextlib.suppress(OSError):
                exp.stack.flush()
            exp.stack.close()
        self._stacks.clear()
        self.layers.close_all()

    async def __aenter__(self) -> BlockServer:  # noqa: PYI034
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _release_unused_layers(self) -> None:
        self.layers.release_unused({d for e in self._stacks.values()
                                    for d in e.stack.layer_digests})

    def _recover(self) -> None:
        """Every stack back from its manifest (uppers replay their journals), a seal cut
        by a crash finished. A stack that cannot be recovered keeps its files and does not
        stop the others."""
        broken = False
        for doc in self.state.manifests():
            name = doc["name"]
            try:
                layers = [self.layers.open(d) for d in doc["layers"]]
                udir = self.state.upper_dir(doc["upper"])
                if (sealed := self.state.finish_seal(udir)) is not None:
                    layers.append(self.layers.open(sealed))
                    upper_id, upper = self.state.new_upper(name, int(doc["virtual_size"]),
                                                           layers[-1].uuid)
                    exp = StackExport(Stack(name, layers, upper), upper_id)
                    self.state.save(exp)
                    shutil.rmtree(udir, ignore_errors=True)
                else:
                    exp = StackExport(Stack(name, layers, Upper.open(udir)), doc["upper"])
                self._stacks[name] = exp
                log.info("recovered stack %s (%d layers)", name, len(layers))
            except StorageError:
                log.exception("cannot recover stack %s; leaving its files in place", name)
                broken = True
        if broken:
            return  # keep every upper dir: a broken stack's upper must not be collected
        for gone in self.state.remove_orphan_uppers({e.upper_id for e in self._stacks.values()}):
            log.info("removed orphan upper %s", gone)

    # --- operations (control API) ---
    def _get(self, name: str) -> StackExport:
        try:
            return self._stacks[name]
        except KeyError:
            raise StackNotFoundError(f"no stack {name!r}") from None

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"bad stack name {name!r}")
        if name in self._stacks:
            raise StackExistsError(f"stack {name!r} exists")

    async def _add(self, exp: StackExport) -> StackInfo:
        await asyncio.to_thread(self.state.save, exp)
        self._stacks[exp.name] = exp
        await self._serve_own(exp.name)
        return exp.info(self.nbd_socket)

    async def create(self, name: str, layers: Sequence[str] = (), *,
                     virtual_size: int | None = None) -> StackInfo:
        async with self._ops_lock:
            self._check_new(name)
            opened = [await asyncio.to_thread(self.layers.open, d) for d in layers]
            if virtual_size is None:
                if not opened:
                    raise ValueError("a stack without layers needs virtual_size")
                virtual_size = opened[-1].virtual_size
            if virtual_size <= 0 or virtual_size % 512:
                raise ValueError(f"virtual_size {virtual_size} must be a positive multiple of 512")
            parent = opened[-1].uuid if opened else ""
            upper_id, upper = await asyncio.to_thread(self.state.new_upper, name, virtual_size,
                                                      parent)
            return await self._add(StackExport(Stack(name, opened, upper), upper_id))

    async def _seal_locked(self, exp: StackExport, user_tag: str) -> str:
        await exp.adopt_prehash()
        old_dir = exp.stack.upper.dir
        new_id = self.state.new_upper_id(exp.name)

        def work() -> SealedLayer:
            layer = exp.stack.seal(self.state.placer(old_dir), self.state.upper_dir(new_id),
                                   user_tag=user_tag.encode())
            exp.upper_id = new_id
            self.state.save(exp)
            shutil.rmtree(old_dir, ignore_errors=True)
            return layer

        layer = await asyncio.to_thread(work)
        shared = self.layers.adopt(layer)
        if shared is not layer:  # identical content already open: the stack shares it
            exp.stack.layers[-1] = shared
            exp.stack.blobs[len(exp.stack.layers) - 1] = shared.blob
        return str(shared.digest)

    async def seal(self, name: str, *, upload: bool = True, user_tag: str = "") -> str:
        """Seal the upper into a new layer; an unchanged disk (empty upper) seals nothing
        and returns the top layer's digest, so repeated pauses do not pile up layers."""
        async with self._ops_lock:
            exp = self._get(name)
            async with exp.lock:
                if not len(exp.stack.upper.index) and exp.stack.layers:
                    digest = str(exp.stack.layers[-1].digest)
                else:
                    digest = await self._seal_locked(exp, user_tag)
        if upload:
            await self.push(digest)
        return digest

    async def clone(self, source: str, name: str, *, upload: bool = False) -> StackInfo:
        async with self._ops_lock:
            self._check_new(name)
            src = self._get(source)
            async with src.lock:
                digest = None
                if len(src.stack.upper.index):
                    digest = await self._seal_locked(src, "")
                parent = src.stack.layers[-1].uuid if src.stack.layers else ""
                upper_id, upper = await asyncio.to_thread(self.state.new_upper, name, src.size,
                                                          parent)
                exp = StackExport(src.stack.fork(name, upper), upper_id)
            info = await self._add(exp)
        if upload and digest:
            await self.push(digest)
        return info

    async def delete(self, name: str) -> None:
        async with self._ops_lock:
            exp = self._get(name)
            del self._stacks[name]
            await self._nbd.disconnect(name)
            own = self._own.pop(name, None)
            if own is not None:
                await own.aclose()
            await asyncio.to_thread(shutil.rmtree, own_socket(self.socket_dir, name).parent, True)
            await exp.aclose_prehash()
            async with exp.lock:
                exp.stack.close()
                self.state.forget(name)
                await asyncio.to_thread(shutil.rmtree, exp.stack.upper.dir, True)
            self._release_unused_layers()

    async def flush(self, name: str) -> None:
        await self._get(name).flush()

    async def prehash(self, name: str) -> None:
        """A seal of `name` is coming: start hashing its upper now (see StackExport)."""
        self._get(name).prehash()

    async def info(self, name: str) -> StackInfo:
        return self._get(name).info(self.nbd_socket)

    async def list(self) -> builtins.list[StackInfo]:
        return [self._stacks[n].info(self.nbd_socket) for n in sorted(self._stacks)]

    async def import_layer(self, path: str, *, upload: bool = True) -> str:
        """Validate a sealed layer file, copy it into layers/, optionally upload it."""
        digest = await asyncio.to_thread(self.state.import_file, path)
        if upload:
            await self.push(digest)
        return digest

    async def export_raw(self, name: str, path: str) -> dict[str, Any]:
        """Write stack `name` as a sparse raw image at the new file `path` (convert.py's
        `write_raw`): the host-side image importer applies OCI layers onto such a copy and
        turns what changed into a layer (host/runtime/hostimport.py)."""
        stack = self._get(name).stack
        return {"bytes": await asyncio.to_thread(write_raw, stack, path)}

    async def compact(self, name: str, start: int, *, upload: bool = True) -> dict[str, Any]:
        """Merge stack `name`'s sealed layers from index `start` up into one (compact.py)
        and put it under the upper in their place. The copy runs off every lock (sealed
        layers never change), so the guest's I/O and other operations go on; the swap is
        skipped if the stack went or its layers changed below their top meanwhile (the
        caller tries again later; the unused merged layer is collected); layers sealed on
        top meanwhile stay on top. Returns the merged digest (None: skipped)."""
        exp = self._get(name)
        before = list(exp.stack.layers)
        run = before[start:]
        if start < 0 or len(run) < 2:
            return {"digest": None, "merged": 0, "layers": len(before)}
        tmp = self.state.merge_target()

        def work() -> tuple[str, SealedLayer, SegmentIndex]:
            digest = write_merged(run, tmp)
            dst = self.state.install(tmp, digest)
            layer = SealedLayer.open_path(dst, digest=digest)
            return digest, layer, merge_layers([*before[:start], layer])

        with self.layers.reading([str(x.digest) for x in run]):
            try:
                digest, layer, below = await asyncio.to_thread(work)
            finally:
                tmp.unlink(missing_ok=True)
        if self._stacks.get(name) is not exp:
            self._release_unused_layers()  # what a delete meanwhile left open for the copy
        if upload:
            await self.push(digest)
        async with self._ops_lock:
            now = exp.stack.layers
            if self._stacks.get(name) is not exp or now[:len(before)] != before:
                layer.close()  # deleted, or recreated: the merged file is collected later
                log.info("stack %s changed during its compaction; not swapped", name)
                return {"digest": None, "merged": 0, "layers": len(now)}
            layer = self.layers.adopt(layer)
            layers = [*before[:start], layer, *now[len(before):]]  # pauses meanwhile stay on top
            if len(now) > len(before):
                below = await asyncio.to_thread(merge_layers, layers)
            await exp.rebase(layers, below)
            await asyncio.to_thread(self.state.save, exp)
        log.info("stack %s: layers %d-%d merged into %s", name, start, len(before) - 1, digest)
        return {"digest": digest, "merged": len(run), "layers": len(exp.stack.layers)}

    async def collect(self, keep: builtins.list[str], *, min_age_s: float = 600.0,
                      dry_run: bool = False, repository: str = "none") -> dict[str, Any]:
        """Remove the sealed layers no stack of this server uses and `keep` does not name,
        older than `min_age_s` (collect.py says why age). `repository` says what happens
        to the repository's copies (the caller knows who else uses the repository):
        "none" (they stay), "sweep" (a posix_fs repository this node alone uses: its
        layers go by the same rule) or "own" (a shared one: the copy of each layer
        removed here goes first, as this node made it; no other layer is touched).
        Under the ops lock: no stack is created over a layer while it goes."""
        if repository not in ("none", "sweep", "own"):
            raise ValueError(f"repository must be none, sweep or own, not {repository!r}")
        async with self._ops_lock:
            used = {d for e in self._stacks.values() for d in e.stack.layer_digests}
            used |= self.layers.pinned()
            keep_all = used | set(keep)
            links: dict[tuple[int, int], list[int]] = {}  # bytes freed counted once
            remote = Swept()
            first = None
            if repository == "own" and self.repository is not None:
                repo = self.repository

                def first(stem: str, st: os.stat_result) -> None:
                    remote.add_bytes(stem, repo.delete_layer(f"sha256:{stem}"))

            local = await asyncio.to_thread(
                sweep_layers, self.state.layers, keep_all, min_age_s=min_age_s,
                dry_run=dry_run, links=links, first=first)
            if repository == "own" and dry_run:
                remote = Swept(files=local.files, bytes=local.bytes, digests=local.digests)
            layers_dir = getattr(self.repository, "layers_dir", None)
            if repository == "sweep" and isinstance(layers_dir, Path):
                remote = await asyncio.to_thread(
                    sweep_layers, layers_dir, keep_all, min_age_s=min_age_s,
                    dry_run=dry_run, links=links)
            if not dry_run:
                self._release_unused_layers()  # closes what was open of the removed ones
                heap.trim()  # what the layers' indexes held goes back (host/heap.py)
            if local.files or remote.files:
                log.info("layers %s: %d local, %d in the repository, %d bytes",
                         "collectable" if dry_run else "collected", local.files,
                         remote.files, local.bytes + remote.bytes)
            return {"local": local.to_dict(), "repository": remote.to_dict(),
                    "in_use": sorted(used)}

    def stats(self) -> dict[str, Any]:
        """Counters for the host's metrics: the chunk cache (None without one) and the
        bytes moved to and from the repository (None without one), since this start."""
        cache = repo = None
        if self.cache is not None:
            c = self.cache
            cache = {"used_bytes": c.used_bytes, "capacity_bytes": c.capacity_bytes,
                     "hits": c.stats.hits, "misses": c.stats.misses}
        moved = getattr(self.repository, "transferred", None)
        if moved is not None:
            repo = {"backend": getattr(self.repository, "backend", "unknown"),
                    "upload_bytes": moved.upload_bytes, "download_bytes": moved.download_bytes}
            if isinstance(self.repository, PeerLayers):   # --p2p: what neighbours served
                repo["peer_bytes"] = self.repository.peer_bytes
        return {"cache": cache, "repository": repo}

    async def push(self, digest: str) -> None:
        if self.repository is None:
            return
        local = self.state.layer_path(digest)
        if not local.exists():
            if await asyncio.to_thread(self.repository.has_layer, digest):
                return
            raise LayerNotFoundError(f"layer {digest} not on this node")
        await asyncio.to_thread(self.repository.put_layer, digest, local)


def build_server(args: argparse.Namespace) -> BlockServer:
    repo: Repository | None = open_repository(args.repo) if args.repo else None
    if repo is not None and getattr(args, "peers_file", None):
        repo = PeerLayers(repo, Path(args.peers_file))   # a cluster node's --p2p
    cache = None
    if args.cache_dir:
        cache = ChunkCache(args.cache_dir, capacity_bytes=args.cache_mib << 20,
                           high=args.cache_high, low=args.cache_low)
    return BlockServer(socket_dir=args.socket_dir, state_dir=args.state_dir, repository=repo,
                       cache=cache)


async def _amain(args: argparse.Namespace) -> None:
    server = build_server(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        log.info("block server ready: nbd %s, control %s", server.nbd_socket,
                 server.control_socket)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    heap.configure()  # before any thread (host/heap.py)
    p = argparse.ArgumentParser(prog="python -m host.storage.blockserver",
                                description="Serve layered block stacks over NBD.")
    p.add_argument("--socket-dir", required=True, help="where nbd.sock and control.sock live")
    p.add_argument("--state-dir", required=True, help="layers, uppers and stack manifests")
    p.add_argument("--repo", default=None,
                   help="posix_fs:/DIR or oss://BUCKET/PREFIX?endpoint=URL&region=R")
    p.add_argument("--cache-dir", default=None, help="chunk cache for remote layers")
    p.add_argument("--cache-mib", type=int, default=10240, help="chunk cache capacity")
    p.add_argument("--cache-high", type=float, default=0.95,
                   help="evict when the cache is this full (fraction of --cache-mib)")
    p.add_argument("--cache-low", type=float, default=0.70, help="...down to this fraction")
    p.add_argument("--peers-file", default=None,
                   help="neighbours to read remote layers from first (storage/peers.py)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_amain(args))


if __name__ == "__main__":
    main()
