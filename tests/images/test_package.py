"""host/images: the README names every module; every name in `__all__` exists."""

from __future__ import annotations

from pathlib import Path

from host import images

PACKAGE = Path(images.__file__).parent


def test_readme_names_every_module() -> None:
    readme = (PACKAGE / "README.md").read_text()
    missing = [p.name for p in sorted(PACKAGE.glob("*.py"))
               if p.name != "__init__.py" and f"`{p.name}`" not in readme]
    assert not missing


def test_exports() -> None:
    for name in images.__all__:
        assert hasattr(images, name), name
    assert images.APPLY_SCRIPT.is_file()
