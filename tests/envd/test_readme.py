"""envd/README.md names every module of envd, in the section of its package."""

from __future__ import annotations

import re
from pathlib import Path

ENVD = Path(__file__).resolve().parents[2] / "envd"


def _sections(text: str) -> dict[str, str]:
    """`## envd/http — ...` heading -> its body (the package dir relative to the repo)."""
    parts = re.split(r"^## (\S+).*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_readme_names_every_module():
    sections = _sections((ENVD / "README.md").read_text(encoding="utf-8"))
    missing = []
    for path in sorted(ENVD.rglob("*.py")):
        if path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ENVD.parent).as_posix()
        # the deepest section whose package holds the module
        package = max((s for s in sections if rel.startswith(s + "/")), key=len, default=None)
        if package is None or f"`{rel.removeprefix(package + '/')}`" not in sections[package]:
            missing.append(rel)
    assert not missing, f"envd/README.md does not name: {missing}"
