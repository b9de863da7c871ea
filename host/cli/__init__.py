"""The native `aenv` CLI: sandbox lifecycle over the REST API, commands, files and an
interactive terminal over envd through the sandbox proxy."""

from .commands import cli, main
from .errors import ApiError, CliError, ConnectionFailed

__all__ = ["ApiError", "CliError", "ConnectionFailed", "cli", "main"]
