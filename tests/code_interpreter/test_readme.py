"""templates/code-interpreter/README.md names every module of the server package."""

from __future__ import annotations

from .conftest import TEMPLATE


def test_readme_names_every_module() -> None:
    text = (TEMPLATE / "README.md").read_text(encoding="utf-8")
    package = TEMPLATE / "server" / "aenv_code_interpreter"
    missing = [m.name for m in sorted(package.glob("*.py"))
               if m.name != "__init__.py" and f"`{m.name}`" not in text]
    assert not missing, f"the README does not name {missing}"
