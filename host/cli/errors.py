"""Errors of the CLI and the exit codes they map to.

    CliError              any expected failure: one line on stderr, exit `exit_code`
      ApiError            the REST API or envd answered with an error status
      ConnectionFailed    the server could not be reached
      CredentialsError    the credentials file cannot be read, written or removed

Exit codes (the table README.md documents):

    0    success
    1    generic failure: an API error without a code of its own (400, 5xx), the service
         unreachable, a failed build, a fork with a failed child
    2    usage: a bad option or argument (click)
    3    authentication: no API key, or the key was rejected (401/403)
    4    not found (404): no such sandbox, snapshot, template or file
    5    conflict (409), e.g. pausing a paused sandbox
    130  interrupted by Ctrl-C (exec: the remote process is killed; a build goes on)

`aenv exec`, `terminal` and `connect` exit with the remote command's exit code instead.
Every message says what went wrong and, where there is one, what to do about it: the
`hint`, written after the message on the same line.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_GENERIC = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_CONFLICT = 5
EXIT_INTERRUPTED = 130

_BY_STATUS = {401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 409: EXIT_CONFLICT}


class CliError(Exception):
    """An expected failure, reported as one line on stderr without a traceback.

    `hint` says what to do; it carries its own separator (`: run ...`, ` (see ...)`)."""

    def __init__(self, message: str, exit_code: int = EXIT_GENERIC, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.hint = hint

    def line(self) -> str:
        """The one line shown on stderr (after `aenv: `)."""
        return self.message + self.hint


class ApiError(CliError):
    """An HTTP error answer; the message carries the status and the server's message."""

    def __init__(self, status: int, message: str, *, what: str = "API", hint: str = "") -> None:
        super().__init__(f"{what} error {status}: {message}",
                         _BY_STATUS.get(status, EXIT_GENERIC), hint=hint)
        self.status = status
        self.server_message = message
        self.what = what


class ConnectionFailed(CliError):
    """The API or the sandbox proxy did not answer at all."""


class CredentialsError(CliError):
    """The credentials file (credentials.py) cannot be read, written or removed, or is
    not what `aenv auth login` writes."""


def exit_code_for_status(status: int) -> int:
    return _BY_STATUS.get(status, EXIT_GENERIC)
