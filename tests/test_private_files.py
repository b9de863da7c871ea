"""Secrets on disk are root's only, whatever the umask (run with the usual 0022): the state
dir (0700), its database with -wal/-shm, the API keys, the TLS keys and the upload-signing
key (0600), frozen guest memory (0400), the runtime's state and run dirs (0700). No VM is
booted: each owner's own helpers are called directly. (VM work dirs and materialised
memory: tests/vmm/test_firecracker_memory.py; memsnap flattening: its API test.)"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.api.auth import ApiKeys
from host.api.uploads import SECRET_FILE, UploadSigner
from host.durable import write_atomic
from host.orchestrator import Store
from host.private import write_private
from host.proxy.tls import ensure_certificates
from host.runtime.config import RuntimeConfig
from host.runtime.node import make_dirs
from host.vmm.memsnap import copy_sparse_hashing
from host.vmm.memsnap.base import install_base


@pytest.fixture(autouse=True)
def umask_0022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dir_and_database(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = Store(state / "state.db")
    try:
        store.list_sandboxes()   # a read and the schema writes: -wal and -shm exist now
        assert mode(state) == 0o700
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            assert mode(state / name) == 0o600, name
    finally:
        store.close()


def test_existing_state_dir_and_database_are_tightened(tmp_path: Path) -> None:
    state = tmp_path / "state"
    Store(state / "state.db").close()
    os.chmod(state, 0o755)       # as made by an older version
    os.chmod(state / "state.db", 0o644)
    store = Store(state / "state.db")
    try:
        store.list_sandboxes()
        assert mode(state) == 0o700
        assert {mode(p) for p in state.iterdir()} == {0o600}
    finally:
        store.close()


def test_keys(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ApiKeys.load_or_create(state / "api_keys")
    UploadSigner.load_or_create(state / SECRET_FILE)
    assert mode(state) == 0o700
    assert mode(state / "api_keys") == 0o600 and mode(state / SECRET_FILE) == 0o600


def test_tls_keys(tmp_path: Path) -> None:
    tls = tmp_path / "tls"
    tls.mkdir(mode=0o755)
    # a temporary key file left world-readable by a crash mid-write
    (tls / "ca-key.pem.tmp").write_text("stale")
    paths = ensure_certificates(tls, "sbx.example.com")
    assert mode(tls) == 0o700
    assert mode(tls / "ca-key.pem") == 0o600 and mode(paths.key) == 0o600


def test_runtime_dirs(tmp_path: Path) -> None:
    cfg = RuntimeConfig(state_dir=tmp_path / "state", run_dir=tmp_path / "run" / "rt")
    make_dirs(cfg)
    for d in (cfg.state_dir, cfg.memory_dir, cfg.run_dir, cfg.vms_dir, cfg.storage_run_dir):
        assert mode(d) == 0o700, d


def test_frozen_memory_base(tmp_path: Path) -> None:
    ram = tmp_path / "ram.mem"
    ram.write_bytes(b"guest secrets".ljust(1 << 16, b"\0"))
    copy_sparse_hashing(ram, tmp_path / "copy.mem")
    assert mode(tmp_path / "copy.mem") == 0o600
    d = tmp_path / "base"
    d.mkdir()
    (d / "base.dev").write_bytes(b"devices")
    base = install_base(d, ram, d / "base.dev", t0=time.perf_counter())
    assert mode(base.mem_path) == 0o444


def test_atomic_writes_are_private_whole_and_leave_no_temp(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`host.durable.write_atomic` (stack manifests, memory manifests, holdings, every
    `write_private`): the new file is 0600 under umask 0022 and replaces the old one whole;
    a write that fails leaves the old content and no temporary file."""
    path = tmp_path / "peers.json"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    write_private(path, b"new content")
    assert path.read_bytes() == b"new content" and mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.json"]

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="Input/output"):
        write_atomic(path, b"never seen")
    assert path.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.json"]
