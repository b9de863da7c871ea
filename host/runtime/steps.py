"""Template build steps as guest commands: RUN, COPY, ENV, WORKDIR, USER (E2B's step
semantics: docs/e2b-template-api.md §5).

`execute()` runs one step in the build VM and returns whether it touched the disk (then
the caller seals a layer) and the guest defaults after it (ENV, WORKDIR and USER change
them; later steps and the template's sandboxes use them).
"""

from __future__ import annotations

import dataclasses
import posixpath
import shlex
from pathlib import Path

from host.contract import STEP_TYPES, BuildFailed, BuildStep, GuestDefaults

from .guest_shell import GuestCommandError, GuestShell, OnOutput

_GLOB = set("*?[")


def describe(step: BuildStep) -> str:
    args = " ".join(step.args if step.type.upper() != "ENV" else step.args[::2])
    return f"{step.type.upper()} {args}"[:200]


def _resolve(path: str, workdir: str) -> str:
    return posixpath.normpath(posixpath.join(workdir, path))


def _owner(user: str) -> str:
    return user if ":" in user else f"{user}:{user}"


def copy_script(archive: str, src: str, dest: str, owner: str, mode: str) -> str:
    """Shell (run as root) that unpacks the uploaded archive and puts `src` (as the SDK
    archived it: paths relative to its context dir, possibly a glob) at `dest`: a
    directory's contents into `dest`; a file into `dest` when `dest` ends with '/' or is
    a directory, else as `dest`; each glob match into `dest/`. What it placed gets
    `owner` (recursively) and `mode`."""
    q = shlex.quote
    fix = f'chown -R {q(owner)} "$t" 2>/dev/null || chown -R {q(owner.split(":")[0])} "$t"'
    if mode:
        fix += f'; chmod {q(mode)} "$t"'
    d = q(dest.rstrip("/") or "/")
    # `put`: hard links when the staging dir and `dest` share a filesystem (the usual
    # case now that /tmp is on the sandbox disk): a 300 MB tree lands without a second
    # copy of its data; a copy otherwise
    lines = ["set -e", 'put() { cp -a -l -f "$@" 2>/dev/null || cp -a "$@"; }',
             'u=$(mktemp -d /tmp/.aenv-copy.XXXXXX)', f'tar -xf {q(archive)} -C "$u"',
             f"rm -f {q(archive)}"]
    if any(c in _GLOB for c in src):
        pattern = "/".join(p if any(c in _GLOB for c in p) else q(p) for p in src.split("/"))
        lines += [f"mkdir -p {d}",
                  (f'for f in "$u"/{pattern}; do [ -e "$f" ] || [ -L "$f" ] || continue; '
                  f'put "$f" {d}/; t={d}/"$(basename "$f")"; {fix}; done')]
    else:
        sp = f'"$u"/{q(src.strip("/") or ".")}'
        into_dir = "true" if dest.endswith("/") else "false"
        lines += [
            f"if [ -d {sp} ] && [ ! -L {sp} ]; then mkdir -p {d}; put {sp}/. {d}/; t={d}",
            (f"elif [ -d {d} ] || {into_dir}; then mkdir -p {d}; put {sp} {d}/; "
            f't={d}/"$(basename {sp})"'),
            f'else mkdir -p "$(dirname {d})"; put {sp} {d}; t={d}; fi',
            fix,
        ]
    lines.append('rm -rf "$u"')
    return "\n".join(lines)


def validate(steps: tuple[BuildStep, ...], files_dir: Path | None) -> None:
    """Refuse a build whose steps cannot run (before any VM is booted)."""
    for i, step in enumerate(steps, 1):
        kind = step.type.upper()
        if kind not in STEP_TYPES:
            raise BuildFailed(f"step {i}: unknown step type {step.type!r} (supported: "
                              f"{', '.join(STEP_TYPES)})", step=str(i))
        need = {"RUN": 1, "COPY": 2, "ENV": 0, "WORKDIR": 1, "USER": 1}[kind]
        if len(step.args) < need or (need and not step.args[0]):
            raise BuildFailed(f"step {i}: {kind} is missing arguments", step=str(i))
        if kind == "ENV" and len(step.args) % 2:
            raise BuildFailed(f"step {i}: ENV needs key/value pairs", step=str(i))
        if kind == "COPY" and (files_dir is None or not step.files_hash
                               or not (files_dir / step.files_hash).is_file()):
            raise BuildFailed(f"step {i}: the files of COPY {step.args[0]!r} were never "
                              f"uploaded (hash {step.files_hash})", step=str(i))


async def execute(shell: GuestShell, step: BuildStep, guest: GuestDefaults,
                  files_dir: Path | None, *, index: int,
                  on_output: OnOutput) -> tuple[bool, GuestDefaults]:
    kind = step.type.upper()
    where = str(index)
    if kind not in STEP_TYPES:
        raise BuildFailed(f"step {index}: unknown step type {step.type!r}", step=where)
    try:
        if kind == "ENV":
            if len(step.args) % 2:
                raise BuildFailed(f"step {index}: ENV needs key/value pairs", step=where)
            env = dict(guest.env)
            env.update(zip(step.args[::2], step.args[1::2], strict=True))
            return False, dataclasses.replace(guest, env=env)
        if kind == "WORKDIR":
            path = _resolve(step.args[0], guest.workdir)
            await _root(shell, f"mkdir -p {shlex.quote(path)} && chown "
                        f"{shlex.quote(_owner(guest.user))} {shlex.quote(path)} 2>/dev/null "
                        f"|| true", index, on_output)
            return True, dataclasses.replace(guest, workdir=path)
        if kind == "USER":
            name = step.args[0]
            q = shlex.quote(name)
            await _root(shell, f"id -u {q} >/dev/null 2>&1 || useradd -m -s /bin/sh {q} "
                        f"2>/dev/null || adduser -D {q}", index, on_output)
            return True, dataclasses.replace(guest, user=name)
        if kind == "RUN":
            user = step.args[1] if len(step.args) > 1 and step.args[1] else guest.user
            cmd = step.args[0]
            # E2B's builder words a failed RUN so (both SDKs' suites match the text)
            failed = f"failed to run command '{cmd[:500]}'"
            try:
                code = await shell.run(cmd, user=user, env=guest.env, cwd=guest.workdir,
                                       on_output=on_output, login=True)
            except GuestCommandError as exc:
                raise BuildFailed(f"{failed}: {exc}", step=where) from exc
            if code != 0:
                raise BuildFailed(f"{failed}: exit status {code}", step=where)
            return True, guest
        # COPY
        if files_dir is None or not step.files_hash:
            raise BuildFailed(f"step {index}: COPY without uploaded files", step=where)
        archive = files_dir / step.files_hash
        if not archive.is_file():
            raise BuildFailed(f"step {index}: the files of COPY {step.args[0]!r} were never "
                              f"uploaded (hash {step.files_hash})", step=where)
        src, dest = step.args[0], _resolve(step.args[1], guest.workdir)
        if step.args[1].endswith("/"):
            dest += "/"
        owner = _owner(step.args[2] if len(step.args) > 2 and step.args[2] else guest.user)
        mode = step.args[3] if len(step.args) > 3 else ""
        guest_archive = f"/tmp/.aenv-copy-{step.files_hash}.tar"
        await shell.upload(archive, guest_archive)
        await _root(shell, copy_script(guest_archive, src, dest, owner, mode), index, on_output)
        return True, guest
    except GuestCommandError as exc:
        raise BuildFailed(f"step {index}: {exc}", step=where) from exc
    except IndexError:
        raise BuildFailed(f"step {index}: {kind} is missing arguments", step=where) from None


async def _root(shell: GuestShell, script: str, index: int, on_output: OnOutput) -> None:
    code = await shell.run(script, user="root", on_output=on_output)
    if code != 0:
        raise BuildFailed(f"step {index} failed with exit code {code}", step=str(index))
