"""Fixtures for memsnap tests: sparse base files and helper processes that map them.

``children`` collects ``Child`` processes (MAP_PRIVATE of a base file, like a share=off QEMU)
and guarantees they are killed and reaped after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .memsnap_helpers import Child, make_base


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """A list to spawn into with ``Child(base)``; every child is killed and reaped afterwards."""
    made: list[Child] = []
    yield made
    for c in made:
        c.kill()


@pytest.fixture
def base_file(tmp_path: Path) -> Path:
    """A 1024-page (4 MiB) sparse base with data in every 7th page."""
    return make_base(tmp_path / "base.mem", 1024, list(range(0, 1024, 7)))
