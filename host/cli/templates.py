"""The template commands: `aenv template build|ls|rm`, `aenv build` (the same command as
`template build`) and `aenv pull` (a template from an OCI image). Builds run in the e2b
SDK (builder.py, imported on first use), their log shown by progress.py; listing and
deleting are REST calls (rest.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from .invocation import settings
from .output import echo_table, emit_json, output_option, rfc3339
from .progress import BuildProgress, is_terminal

if TYPE_CHECKING:
    from e2b import TemplateClass

F = TypeVar("F", bound=Callable[..., Any])

def build_options(f: F) -> F:
    """The options every build takes (E2B's Template.build arguments)."""
    for option in reversed((
            click.option("--name", "-n", required=True,
                         help="Template name: NAME, NAME:TAG or NAMESPACE/NAME[:TAG]."),
            click.option("--tag", "tags", multiple=True, help="Another tag of the build."),
            click.option("--cpu", "cpu_count", type=click.IntRange(min=1), default=None,
                         help="vCPUs of the template's sandboxes."),
            click.option("--memory-mb", type=click.IntRange(min=128), default=None,
                         help="Memory (MiB) of the template's sandboxes."),
            click.option("--skip-cache", is_flag=True, help="Rebuild every step."),
            output_option)):
        f = option(f)
    return f


def _build(ctx: click.Context, template: TemplateClass, *, name: str, tags: Sequence[str],
           cpu_count: int | None, memory_mb: int | None, skip_cache: bool,
           output: str) -> None:
    """Run the build with its log on stdout (stderr with -o json), then print the result."""
    from . import builder

    s = settings(ctx)
    as_json = output == "json"
    stream = sys.stderr if as_json else sys.stdout
    opts = builder.BuildOptions(name=name, tags=tuple(tags), cpu_count=cpu_count,
                                memory_mb=memory_mb, skip_cache=skip_cache)
    with BuildProgress(stream, live=is_terminal(stream)) as progress:
        built = builder.build(template, opts, api_url=s.api_url, api_key=s.api_key,
                              on_log=progress)
    if as_json:
        emit_json(built.wire())
    else:
        click.echo(f"Built {built.name}: template {built.template_id}, build "
                   f"{built.build_id}, tags {', '.join(built.tags) or '-'}")


@click.group("template")
def template() -> None:
    """Build, list and delete templates."""


@click.command("build")
@click.argument("path", metavar="DIR_OR_DOCKERFILE")
@build_options
@click.pass_context
def build(ctx: click.Context, /, path: str, **opts: Any) -> None:
    """Build a template from a Dockerfile (or a directory holding one).

    COPY sources are relative to the Dockerfile's directory; FROM names an OCI image
    (e2bdev/base: the built-in base image); CMD/ENTRYPOINT become the start command.
    """
    from . import builder

    _build(ctx, builder.dockerfile_template(path), **opts)


@click.command()
@click.argument("image")
@build_options
@click.option("--start-cmd", default=None, help="Started in every sandbox of the template.")
@click.option("--ready-cmd", default=None,
              help="Exits 0 once the start command is up (default with --start-cmd: "
                   "sleep 20).")
@click.option("--username", default=None, help="Registry user.")
@click.option("--password-stdin", is_flag=True, help="Read the registry password from stdin.")
@click.pass_context
def pull(ctx: click.Context, /, image: str, start_cmd: str | None, ready_cmd: str | None,
         username: str | None, password_stdin: bool, **opts: Any) -> None:
    """Make a template from an OCI image (the service pulls it)."""
    from . import builder

    if bool(username) != password_stdin:
        raise click.UsageError("--username and --password-stdin go together")
    password = None
    if password_stdin:
        password = sys.stdin.read().rstrip("\r\n")
        if not password:
            raise click.UsageError("--password-stdin: stdin held no password")
    _build(ctx, builder.image_template(image, start_cmd=start_cmd, ready_cmd=ready_cmd,
                                       username=username, password=password), **opts)


@template.command("ls")
@output_option
@click.pass_context
def ls(ctx: click.Context, output: str) -> None:
    """List templates (newest first)."""
    items = settings(ctx).api.templates()
    if output == "json":
        emit_json([t.wire() for t in items])
        return
    rows: list[tuple[object, ...]] = [
        ("NAME", "TEMPLATE ID", "STATUS", "CPU", "MEMORY MB", "CREATED")]
    for t in items:
        rows.append((",".join(t.aliases) or "-", t.template_id, t.build_status, t.cpu_count,
                     t.memory_mb, rfc3339(t.created_at)))
    echo_table(rows, style_column=2)


@template.command("rm")
@click.argument("name_or_id")
@click.pass_context
def rm(ctx: click.Context, name_or_id: str) -> None:
    """Delete a template: its names, tags and builds (refused while sandboxes use it)."""
    settings(ctx).api.delete_template(name_or_id)


template.add_command(build)
COMMANDS = (template, build, pull)
