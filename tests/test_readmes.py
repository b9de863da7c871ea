"""Each host package's README.md names every module of the package (envd's single README
is checked by tests/envd/test_readme.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

HOST = Path(__file__).resolve().parents[1] / "host"
PACKAGES = sorted(p.parent for p in HOST.rglob("__init__.py")
                  if p.parent != HOST and "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.relative_to(HOST).as_posix())
def test_package_readme_names_every_module(package: Path) -> None:
    readme = package / "README.md"
    assert readme.is_file(), f"{readme} is missing"
    text = readme.read_text(encoding="utf-8")
    missing = [m.name for m in sorted(package.glob("*.py"))
               if m.name != "__init__.py" and f"`{m.name}`" not in text]
    assert not missing, f"{readme} does not name {missing}"


def test_host_readme_names_every_package_and_module() -> None:
    text = (HOST / "README.md").read_text(encoding="utf-8")
    names = [f"`{p.name}/`" for p in PACKAGES if p.parent == HOST]
    names += [f"`{m.name}`" for m in HOST.glob("*.py") if m.name != "__init__.py"]
    assert not [n for n in names if n not in text]
