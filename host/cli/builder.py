"""Template builds through the e2b SDK's `Template` builder: it converts the Dockerfile,
hashes and uploads COPY sources, starts the build and polls its status and log. The CLI's
API URL and key go to it as arguments (never through the environment), and its exceptions
become CliErrors in `sdk_errors`.

Imported only by the build commands: the SDK takes a while to import.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2b import (
    AuthenticationException,
    BuildException,
    LogEntry,
    RateLimitException,
    SandboxException,
    ServiceBusyException,
    Template,
    TemplateClass,
    wait_for_timeout,
)

from .errors import EXIT_AUTH, EXIT_INTERRUPTED, ApiError, CliError
from .rest import transport_errors

# The ready command when only a start command is given: E2B's default (a Dockerfile's
# CMD gets the same from the SDK, and the service uses it when none is sent).
DEFAULT_READY = wait_for_timeout(20_000)
# "<status>: <message>": how the SDK words an API error answer
_STATUS = re.compile(r"^(\d{3}): (.*)$", re.DOTALL)


@dataclass(frozen=True)
class BuildOptions:
    name: str
    tags: tuple[str, ...] = ()
    cpu_count: int | None = None
    memory_mb: int | None = None
    skip_cache: bool = False


@dataclass(frozen=True)
class Built:
    template_id: str
    build_id: str
    name: str
    tags: list[str] = field(default_factory=list)

    def wire(self) -> dict[str, Any]:
        return {"templateID": self.template_id, "buildID": self.build_id, "name": self.name,
                "tags": self.tags}


def find_dockerfile(arg: str) -> Path:
    """The Dockerfile ARG names: the file itself, or `Dockerfile` in the directory."""
    path = Path(arg)
    if path.is_dir():
        path = path / "Dockerfile"
        if not path.is_file():
            raise CliError(f"no Dockerfile in {arg}")
    elif not path.exists():
        raise CliError(f"{arg}: no such file or directory")
    elif not path.is_file():
        raise CliError(f"{arg}: not a file")
    return path


def dockerfile_template(arg: str) -> TemplateClass:
    """The template a Dockerfile describes; COPY sources are relative to its directory."""
    path = find_dockerfile(arg)
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    template = Template(file_context_path=str(path.parent.resolve()))
    try:
        # the parser prints its warnings to stdout, which may be the JSON result
        with contextlib.redirect_stdout(sys.stderr):
            # content, not the path: from_dockerfile would take a bad path for content
            return template.from_dockerfile(content)
    except ValueError as exc:  # DockerfileSyntaxError and the SDK's other checks
        raise CliError(f"{path}: {exc}") from exc


def image_template(image: str, *, start_cmd: str | None = None, ready_cmd: str | None = None,
                   username: str | None = None, password: str | None = None) -> TemplateClass:
    """A template from an OCI image (from_image), with optional start and ready commands."""
    with sdk_errors():
        builder = Template().from_image(image, username=username, password=password)
        if start_cmd:
            return builder.set_start_cmd(start_cmd, ready_cmd or DEFAULT_READY)
        if ready_cmd:
            return builder.set_ready_cmd(ready_cmd)
        return builder


def build(template: TemplateClass, opts: BuildOptions, *, api_url: str, api_key: str | None,
          on_log: Callable[[LogEntry], None]) -> Built:
    """Run the build to its end, streaming its log to `on_log`."""
    if not api_key:
        raise CliError("no API key", EXIT_AUTH,
                       hint=": run `aenv auth login` or set E2B_API_KEY")
    try:
        with sdk_errors(api_url):
            info = Template.build(
                template, opts.name, tags=list(opts.tags) or None, cpu_count=opts.cpu_count,
                memory_mb=opts.memory_mb, skip_cache=opts.skip_cache, on_build_logs=on_log,
                api_url=api_url, api_key=api_key)
    except KeyboardInterrupt:
        raise CliError("interrupted: a build that had started goes on in the service",
                       EXIT_INTERRUPTED) from None
    return Built(template_id=info.template_id, build_id=info.build_id, name=info.name,
                 tags=list(info.tags))


def api_error(message: str) -> ApiError | None:
    """The ApiError an SDK message "<status>: <message>" stands for (None: not one)."""
    match = _STATUS.match(message)
    if match is None:
        return None
    status, text = int(match.group(1)), match.group(2)
    if status in (401, 429, 503):
        _, sep, server = text.partition(" - ")
        text = server if sep and server else text
    return ApiError(status, text)


@contextlib.contextmanager
def sdk_errors(api_url: str = "") -> Iterator[None]:
    """The SDK's exceptions as one-line CliErrors: API answers as ApiError (their exit
    code by status), a failed build as `build failed: <the step's message>`."""
    try:
        with transport_errors(api_url):
            yield
    except AuthenticationException as exc:
        raise (api_error(str(exc)) or CliError(str(exc), EXIT_AUTH)) from exc
    except BuildException as exc:  # and FileUploadException
        message = str(exc) or "Build failed"
        raise (api_error(message) or CliError(f"build failed: {message}")) from exc
    except (SandboxException, RateLimitException, ServiceBusyException) as exc:
        raise (api_error(str(exc)) or CliError(str(exc))) from exc
    except ValueError as exc:  # the SDK's input checks, e.g. "No files found in <path>"
        raise CliError(str(exc)) from exc
