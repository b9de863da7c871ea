"""`aenv volume create|ls|rm|put|get|files`: volumes and the files in them.

The volumes themselves go through the REST API with the API key (rest.ApiClient:
/volumes); their files through the volume content API (/volumecontent/{id}/..., on the
same server) with the volume's own token from GET /volumes/{id} (`Authorization: Bearer`),
never the API key: `VolumeContent`. A VOLUME argument is an id or a name (looked up in
GET /volumes). File bytes are streamed both ways, with a byte bar on a terminal
(progress.TransferProgress) as `aenv upload` / `download` draw it.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path, PurePosixPath
from typing import IO, Any
from urllib.parse import quote

import click
import httpx

from host.api import volume_models as vm
from host.volumes.files import MAX_DEPTH

from .envd import TransferObserver, received, sent_chunks, whole_file
from .errors import EXIT_NOT_FOUND, ApiError, CliError
from .invocation import settings
from .output import echo_table, emit_json, output_option, rfc3339
from .progress import TransferProgress, is_terminal
from .rest import USER_AGENT, ApiClient, parse, raise_for_status, transport_errors

NOT_FOUND_HINT = " (see `aenv volume ls`)"
# the content API refused the token GET /volumes/{id} just gave: not the API key's fault
TOKEN_HINT = ": the volume's token was refused; try again"


class VolumeContent:
    """The files of one volume: /volumecontent/{id}/... at `api_url`, authenticated with
    the volume's token."""

    def __init__(self, api_url: str, volume_id: str, token: str) -> None:
        self.api_url = api_url.rstrip("/")
        self.base = f"/volumecontent/{quote(volume_id, safe='')}"
        self._http = httpx.Client(
            base_url=self.api_url,
            headers={"User-Agent": USER_AGENT, "Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(60.0, connect=10.0, read=None))

    def close(self) -> None:
        self._http.close()

    def list(self, path: str, depth: int) -> list[vm.VolumeEntryStat]:
        with transport_errors(self.api_url):
            resp = self._http.get(f"{self.base}/dir", params={"path": path, "depth": str(depth)})
        _check(resp)
        return parse(resp, list[vm.VolumeEntryStat])

    def put(self, local: Path, remote: str, *, force: bool, uid: int | None = None,
            gid: int | None = None, mode: int | None = None,
            observer: TransferObserver | None = None) -> vm.VolumeEntryStat:
        """Stream `local` to `remote` (PUT .../file, application/octet-stream); the file
        appears in the volume only once complete. Without `force` an existing `remote` or
        a missing parent directory is refused."""
        try:
            f = local.open("rb")
        except OSError as exc:
            raise CliError(f"cannot read {local}: {exc.strerror or exc}") from exc
        with f:
            size = os.fstat(f.fileno()).st_size
            if observer is not None:
                observer.start(size)
            params = {"path": remote, "force": "true" if force else "false"}
            for key, value in (("uid", uid), ("gid", gid), ("mode", mode)):
                if value is not None:
                    params[key] = str(value)
            with transport_errors(self.api_url):
                resp = self._http.put(f"{self.base}/file", params=params, content=sent_chunks(f, observer),
                                      headers={"Content-Type": "application/octet-stream",
                                               "Content-Length": str(size)})
        _check(resp, {409: ": pass --force to replace it",
                      404: ": its directory does not exist (--force makes it)"})
        return parse(resp, vm.VolumeEntryStat)

    def get(self, remote: str, out: IO[bytes], *,
            observer: TransferObserver | None = None) -> int:
        """Stream the file at `remote` into `out`; returns the bytes written."""
        with transport_errors(self.api_url), self._http.stream(
                "GET", f"{self.base}/file", params={"path": remote}) as resp:
            _check(resp, {404: " (see `aenv volume files`)"})
            return received(resp, out, observer)


def _check(resp: httpx.Response, hints: dict[int, str] | None = None) -> None:
    """raise_for_status, with the hint for the status (`hints`, else the token's)."""
    try:
        raise_for_status(resp)
    except ApiError as exc:
        exc.hint = {401: TOKEN_HINT, 403: TOKEN_HINT, **(hints or {})}.get(exc.status, "")
        raise


def _canonical(volume: str) -> str:
    try:
        return str(uuid.UUID(volume))
    except ValueError:
        return volume


def resolve(api: ApiClient, volume: str) -> vm.Volume:
    """The volume `volume` names: by its id, else by its name (GET /volumes)."""
    items = api.volumes()
    wanted = _canonical(volume)
    for v in items:
        if v.volume_id == wanted:
            return v
    for v in items:
        if v.name == volume:
            return v
    raise CliError(f"volume '{volume}' not found", EXIT_NOT_FOUND, hint=NOT_FOUND_HINT)


def content(ctx: click.Context, volume: str) -> VolumeContent:
    """The files of the volume `volume` names, with a fresh token for them."""
    api = settings(ctx).api
    found = api.volume(resolve(api, volume).volume_id)
    return VolumeContent(api.api_url, found.volume_id, found.token)


class FileMode(click.ParamType):
    """Permission bits in octal: `644`, `0644`, `0o644`."""

    name = "mode"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).lower().removeprefix("0o")
        try:
            mode = int(text, 8)
        except ValueError:
            self.fail(f"{value!r} is not an octal mode (e.g. 644)", param, ctx)
        if not 0 <= mode <= 0o7777:
            self.fail(f"{value!r} is out of range (at most 7777)", param, ctx)
        return mode


VOLUME = click.argument("volume", metavar="VOLUME")


@click.group("volume")
def volume() -> None:
    """Create, list and delete volumes; copy files in and out of them.

    VOLUME is a volume's id or its name."""


@volume.command("create")
@click.argument("name")
@output_option
@click.pass_context
def create(ctx: click.Context, name: str, output: str) -> None:
    """Create a volume; prints its id.

    NAME: letters, digits, '_' and '-', unique (-o json: also the token of its files)."""
    made = settings(ctx).api.create_volume(name)
    if output == "json":
        emit_json(made.wire())
    else:
        click.echo(made.volume_id)


@volume.command("ls")
@output_option
@click.pass_context
def ls(ctx: click.Context, output: str) -> None:
    """List volumes."""
    items = settings(ctx).api.volumes()
    if output == "json":
        emit_json([v.wire() for v in items])
        return
    rows: list[tuple[str, str]] = [("VOLUME ID", "NAME")]
    rows.extend((v.volume_id, v.name) for v in items)
    echo_table(rows)


@volume.command("rm")
@VOLUME
@click.pass_context
def rm(ctx: click.Context, volume: str) -> None:
    """Delete a volume and every file in it."""
    api = settings(ctx).api
    api.delete_volume(resolve(api, volume).volume_id)


@volume.command("put")
@VOLUME
@click.argument("local", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("remote")
@click.option("--force", "-f", is_flag=True,
              help="Replace an existing file; make missing directories.")
@click.option("--uid", type=click.IntRange(0, 2**32 - 1), default=None,
              help="Owner (default 9090).")
@click.option("--gid", type=click.IntRange(0, 2**32 - 1), default=None,
              help="Group (default 9090).")
@click.option("--mode", type=FileMode(), default=None, help="Octal mode (default 666).")
@output_option
@click.pass_context
def put(ctx: click.Context, volume: str, local: Path, remote: str, force: bool,
        uid: int | None, gid: int | None, mode: int | None, output: str) -> None:
    """Copy a local file into the volume.

    A REMOTE ending in / gets LOCAL's name. Without --force an existing file is not
    replaced and a missing directory not made. Streamed; a progress bar and a summary line on a terminal, silent otherwise
    (-o json: the new file's entry)."""
    if remote.endswith("/"):
        remote += local.name
    files = content(ctx, volume)
    live = is_terminal(sys.stderr)
    try:
        with TransferProgress(f"{local.name} ↑", sys.stderr, live=live) as bar:
            entry = files.put(local, remote, force=force, uid=uid, gid=gid, mode=mode,
                              observer=bar)
    finally:
        files.close()
    if output == "json":
        emit_json(entry.wire())
    if live:
        click.echo(f"{local} -> {volume}:{entry.path} ({entry.size} bytes)", err=True)


@volume.command("get")
@VOLUME
@click.argument("remote")
@click.argument("local", required=False, type=click.Path(allow_dash=True, path_type=Path))
@click.pass_context
def get(ctx: click.Context, volume: str, remote: str, local: Path | None) -> None:
    """Copy a file out of the volume.

    LOCAL: a file, a directory, or - (stdout); default: REMOTE's name in the current
    directory. Streamed; a progress bar and a summary line on a terminal, silent otherwise."""
    name = PurePosixPath(remote).name
    to_stdout = local is not None and str(local) == "-"
    if local is None:
        local = Path(name)
    elif local.is_dir():
        local = local / name
    files = content(ctx, volume)
    live = is_terminal(sys.stderr)
    try:
        with TransferProgress(f"{name} ↓", sys.stderr, live=live) as bar:
            if to_stdout:
                size = files.get(remote, sys.stdout.buffer, observer=bar)
                sys.stdout.buffer.flush()
            else:
                size = _download(files, remote, local, bar)
    finally:
        files.close()
    if live:
        click.echo(f"{volume}:{remote} -> {'stdout' if to_stdout else local} "
                   f"({size} bytes)", err=True)


def _download(files: VolumeContent, remote: str, local: Path,
              observer: TransferObserver) -> int:
    """`remote` into `local`, written to a temp file beside it and renamed at the end (a
    failed download leaves no partial file)."""
    with whole_file(local) as out:
        return files.get(remote, out, observer=observer)


@volume.command("files")
@VOLUME
@click.argument("path", default="/")
@click.option("--depth", "-d", type=click.IntRange(1, MAX_DEPTH), default=1,
              show_default=True, help="Levels listed.")
@output_option
@click.pass_context
def list_files(ctx: click.Context, volume: str, path: str, depth: int, output: str) -> None:
    """List the files under PATH (default /).

    Depth-first in name order, --depth levels down."""
    files = content(ctx, volume)
    try:
        entries = files.list(path, depth)
    finally:
        files.close()
    if output == "json":
        emit_json([e.wire() for e in entries])
        return
    rows: list[tuple[object, ...]] = [("TYPE", "MODE", "UID", "GID", "SIZE", "MODIFIED",
                                       "PATH")]
    for e in entries:
        shown = f"{e.path} -> {e.target}" if e.target is not None else e.path
        rows.append((e.type, f"{e.mode:04o}", e.uid, e.gid, e.size, rfc3339(e.mtime), shown))
    echo_table(rows)


COMMANDS = (volume,)
