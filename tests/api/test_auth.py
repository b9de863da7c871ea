"""API keys: generated on first start into a 0600 file, reloaded after, compared exactly."""

from __future__ import annotations

import stat

import pytest

from host.api.auth import ApiKeys


def test_first_start_creates_a_private_key_file(tmp_path) -> None:
    path = tmp_path / "state" / "api_keys"
    keys = ApiKeys.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert key.startswith("e2b_") and len(key) > 30 and keys.first == key
    assert ApiKeys.load_or_create(path).first == key      # stable across restarts
    assert keys.accepts(key) and not keys.accepts(key + "x") and not keys.accepts(None)


def test_several_keys_and_comments(tmp_path) -> None:
    path = tmp_path / "api_keys"
    path.write_text("# operators\nkey-one\n\n  key-two  \n")
    keys = ApiKeys.load_or_create(path)
    assert keys.accepts("key-one") and keys.accepts("key-two") and not keys.accepts("# operators")


def test_empty_key_file_is_an_error(tmp_path) -> None:
    path = tmp_path / "api_keys"
    path.write_text("# nothing\n")
    with pytest.raises(ValueError):
        ApiKeys.load_or_create(path)
