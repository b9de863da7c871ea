"""Shell completion: `aenv completion bash|zsh|fish` prints the script to load (click's
shell_completion scripts, made in-process: what `_AENV_COMPLETE=bash_source aenv`
prints), and sandbox ids complete from the API (`aenv info <TAB>`).

    eval "$(aenv completion bash)"      # ~/.bashrc (bash >= 4.4)
    eval "$(aenv completion zsh)"       # ~/.zshrc
    aenv completion fish > ~/.config/fish/completions/aenv.fish
"""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem, get_completion_class

from .errors import CliError
from .invocation import resolve_settings
from .rest import ApiClient

SHELLS = ("bash", "zsh", "fish")
PROG_NAME = "aenv"
# the variable the scripts set to ask `aenv` for completions (click: _<PROG>_COMPLETE)
COMPLETE_VAR = "_AENV_COMPLETE"
# completing must not hang the shell when the API is slow or away
LOOKUP_TIMEOUT_S = 3.0


def completion_script(root: click.Command, shell: str) -> str:
    """The completion script for `shell`, as `_AENV_COMPLETE={shell}_source aenv` prints."""
    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - SHELLS are click's own
        raise CliError(f"no completion for {shell}")
    return cls(root, {}, PROG_NAME, COMPLETE_VAR).source()


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL.

    \b
    bash: eval "$(aenv completion bash)"   (in ~/.bashrc)
    zsh:  eval "$(aenv completion zsh)"    (in ~/.zshrc)
    fish: aenv completion fish > ~/.config/fish/completions/aenv.fish
    """
    click.echo(completion_script(ctx.find_root().command, shell), nl=False)


def sandbox_ids(ctx: click.Context, param: click.Parameter,
                incomplete: str) -> list[CompletionItem]:
    """The ids of the sandboxes the API lists that start with `incomplete` (the state and
    template as help); nothing at all when the API cannot be asked."""
    root = ctx.find_root()
    try:
        s = resolve_settings(root, api_url=root.params.get("api_url"),
                             api_key=root.params.get("api_key"),
                             sandbox_url=root.params.get("sandbox_url"), warn=False)
        api = ApiClient(s.api_url, s.api_key, timeout_s=LOOKUP_TIMEOUT_S)
        try:
            items = api.list_sandboxes(None)
        finally:
            api.close()
    except Exception:  # noqa: BLE001 - completion must never break the shell
        return []
    return [CompletionItem(i.sandbox_id, help=f"{i.state} {i.alias or i.template_id}")
            for i in items if i.sandbox_id.startswith(incomplete)]


COMMANDS = (completion,)
