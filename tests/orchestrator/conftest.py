"""Fixtures of the orchestrator unit tests: a real SQLite store, the fake runtime and
the fake envd (fakes.py)."""

from __future__ import annotations

import pytest

from host.orchestrator import Store

from .fakes import FakeEnvd, FakeRuntime


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


@pytest.fixture
def rt():
    return FakeRuntime()


@pytest.fixture
def envd(rt):
    e = FakeEnvd()
    rt.envd = e
    return e
