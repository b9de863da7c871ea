"""Errors of the CLI and the exit codes they map to.

    CliError            any expected failure: one line on stderr, exit `exit_code`
      ApiError          the REST API or envd answered with an error status
      ConnectionFailed  the server could not be reached

Exit codes: 1 generic, 2 usage (click), 3 authentication (401/403), 4 not found (404),
5 conflict (409, e.g. pausing a paused sandbox), 130 a build interrupted by Ctrl-C.
`aenv exec` and `aenv terminal` exit with the remote command's exit code instead.
"""

from __future__ import annotations

EXIT_GENERIC = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_CONFLICT = 5
EXIT_INTERRUPTED = 130

_BY_STATUS = {401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_CONFLICT}


class CliError(Exception):
    """An expected failure, reported as one line on stderr without a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_GENERIC) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class ApiError(CliError):
    """An HTTP error answer; the message carries the status and the server's message."""

    def __init__(self, status: int, message: str, *, what: str = "API") -> None:
        super().__init__(f"{what} error {status}: {message}", _BY_STATUS.get(status, EXIT_GENERIC))
        self.status = status
        self.server_message = message


class ConnectionFailed(CliError):
    """The API or the sandbox proxy did not answer at all."""


def exit_code_for_status(status: int) -> int:
    return _BY_STATUS.get(status, EXIT_GENERIC)
