"""SQLite state of one node: sandboxes, snapshots and lifecycle events.

Every state change goes through `transition()`, a conditional UPDATE that commits
before it returns, so a change is durable before the caller acknowledges it and
a conflicting change raises `StateConflict(actual, expected)`.

sqlite3 calls are short (sub-millisecond on WAL) but still blocking: async callers
use the `a*` wrappers, which run them on one dedicated thread (sqlite connections
are not shareable across threads without care; one thread keeps writes ordered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from host.private import open_private, private_dir, tighten

from .errors import SandboxNotFound, SnapshotNotFound, StateConflict
from .states import SandboxState, can_move

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sandboxes (
    id            TEXT PRIMARY KEY,
    template_id   TEXT NOT NULL,
    alias         TEXT,
    state         TEXT NOT NULL,
    cpu_count     INTEGER NOT NULL,
    memory_mb     INTEGER NOT NULL,
    disk_mb       INTEGER NOT NULL,
    started_at    REAL NOT NULL,
    end_at        REAL,                 -- expiry while running; NULL while paused
    ttl_left_s    REAL,                 -- TTL remaining, kept while paused
    auto_pause    INTEGER NOT NULL,
    auto_resume   INTEGER NOT NULL,
    metadata      TEXT NOT NULL,
    env_vars      TEXT NOT NULL,
    envd_token    TEXT,
    traffic_token TEXT,
    network       TEXT NOT NULL,
    snapshot_id   TEXT,                 -- the snapshot a paused sandbox resumes from
    runtime       TEXT NOT NULL,        -- driver-owned facts about the live VM (pid, dirs, ports)
    parent_id     TEXT,
    updated_at    REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS snapshots (
    id          TEXT PRIMARY KEY,
    sandbox_id  TEXT,
    name        TEXT,
    kind        TEXT NOT NULL,          -- template | pause | named | fork
    parent_id   TEXT,
    created_at  REAL NOT NULL,
    spec        TEXT NOT NULL           -- cpu/mem/disk/kernel/image facts needed to restore
);
CREATE INDEX IF NOT EXISTS snapshots_sandbox ON snapshots(sandbox_id);
CREATE TABLE IF NOT EXISTS events (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id  TEXT NOT NULL,
    kind        TEXT NOT NULL,
    ts          REAL NOT NULL,
    detail      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id, seq);
CREATE TABLE IF NOT EXISTS idempotency (
    key         TEXT PRIMARY KEY,
    request     TEXT NOT NULL,
    sandbox_id  TEXT,
    created_at  REAL NOT NULL
);
"""

_JSON_FIELDS = {"metadata", "env_vars", "network", "runtime", "spec", "detail"}


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    template_id: str
    state: SandboxState
    cpu_count: int
    memory_mb: int
    disk_mb: int
    started_at: float
    end_at: float | None
    auto_pause: bool = True
    auto_resume: bool = False
    alias: str | None = None
    ttl_left_s: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_token: str | None = None
    traffic_token: str | None = None
    network: dict[str, Any] = field(default_factory=dict)
    snapshot_id: str | None = None
    runtime: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None
    updated_at: float = 0.0


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    kind: str
    created_at: float
    sandbox_id: str | None = None
    name: str | None = None
    parent_id: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    seq: int
    sandbox_id: str
    kind: str
    ts: float
    detail: dict[str, Any]


def _encode(name: str, value: Any) -> Any:
    if name in _JSON_FIELDS:
        return json.dumps(value, sort_keys=True)
    if isinstance(value, SandboxState):
        return value.value
    if isinstance(value, bool):
        return int(value)
    return value


def _decode_row(cls: type, row: sqlite3.Row) -> Any:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        v = row[f.name]
        if f.name in _JSON_FIELDS:
            v = json.loads(v)
        elif f.name == "state":
            v = SandboxState(v)
        elif f.name in ("auto_pause", "auto_resume"):
            v = bool(v)
        kwargs[f.name] = v
    return cls(**kwargs)


class Store:
    """The node's SQLite database. One instance per host service process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Root's only (it holds tokens): the dir, and the file made 0600 before SQLite
        # opens it, which gives its -wal and -shm the database file's mode.
        private_dir(self.path.parent)
        os.close(open_private(self.path, os.O_RDWR))
        for extra in ("-wal", "-shm"):
            tighten(f"{self.path}{extra}")
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a transition survives power loss
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._db.close()

    async def run(self, fn, /, *args, **kwargs):
        """Run one store method on the store thread (for async callers)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    # ---- for the store's extensions (templates/store.py): same connection and thread ----
    def add_schema(self, script: str) -> None:
        """Create an extension's tables (`CREATE ... IF NOT EXISTS`: an older database
        gains them when it is opened, its data untouched)."""
        with self._lock:
            self._db.executescript(script)

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE ... COMMIT, rolled back on error)."""
        return self._tx()

    def select(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        """Rows of one read query."""
        return self._db.execute(sql, list(args)).fetchall()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- sandboxes -------------------------------------------------------------------
    def insert_sandbox(self, rec: SandboxRecord, *, event: dict[str, Any] | None = None,
                       snapshot: SnapshotRecord | None = None) -> SandboxRecord:
        """Insert `rec` (and `snapshot`, the one it resumes from, in the same transaction:
        a sandbox taken over from another node, handoff.py)."""
        rec = replace(rec, updated_at=time.time())
        names = [f.name for f in fields(SandboxRecord)]
        with self._tx() as db:
            db.execute(
                f"INSERT INTO sandboxes ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                [_encode(n, getattr(rec, n)) for n in names],
            )
            if snapshot is not None:
                self._insert_snapshot(db, snapshot)
            self._event(db, rec.id, rec.state.value, event or {})
        return rec

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord:
        row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        if row is None:
            raise SandboxNotFound(sandbox_id)
        return _decode_row(SandboxRecord, row)

    def list_sandboxes(self, states: Iterable[SandboxState] | None = None) -> list[SandboxRecord]:
        if states is None:
            rows = self._db.execute("SELECT * FROM sandboxes ORDER BY started_at").fetchall()
        else:
            vals = [s.value for s in states]
            rows = self._db.execute(
                f"SELECT * FROM sandboxes WHERE state IN ({', '.join('?' * len(vals))}) "
                "ORDER BY started_at", vals).fetchall()
        return [_decode_row(SandboxRecord, r) for r in rows]

    def transition(
        self,
        sandbox_id: str,
        expected: Iterable[SandboxState],
        new: SandboxState,
        *,
        event: dict[str, Any] | None = None,
        **changes: Any,
    ) -> SandboxRecord:
        """Move `sandbox_id` from one of `expected` to `new`, with field changes, durably.

        Raises SandboxNotFound, or StateConflict when the current state is not expected.
        """
        expected = frozenset(expected)
        with self._tx() as db:
            row = db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
            if row is None:
                raise SandboxNotFound(sandbox_id)
            cur = _decode_row(SandboxRecord, row)
            if cur.state not in expected:
                raise StateConflict(sandbox_id, cur.state, expected)
            if new != cur.state and not can_move(cur.state, new):
                raise StateConflict(sandbox_id, cur.state, expected)
            rec = replace(cur, state=new, updated_at=time.time(), **changes)
            cols = ["state", "updated_at", *changes]
            db.execute(
                f"UPDATE sandboxes SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                [_encode(c, getattr(rec, c)) for c in cols] + [sandbox_id],
            )
            if new != cur.state or event is not None:
                self._event(db, sandbox_id, new.value, event or {})
        return rec

    def update_fields(self, sandbox_id: str, **changes: Any) -> SandboxRecord:
        """Change non-state fields (TTL, metadata, network) without a transition."""
        if "state" in changes:
            raise ValueError("use transition() to change state")
        with self._tx() as db:
            row = db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
            if row is None:
                raise SandboxNotFound(sandbox_id)
            rec = replace(_decode_row(SandboxRecord, row), updated_at=time.time(), **changes)
            cols = ["updated_at", *changes]
            db.execute(
                f"UPDATE sandboxes SET {', '.join(f'{c} = ?' for c in cols)} WHERE id = ?",
                [_encode(c, getattr(rec, c)) for c in cols] + [sandbox_id],
            )
        return rec

    def delete_sandbox(self, sandbox_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))

    def prune_killed(self, before: float, *, dry_run: bool = False) -> dict[str, int]:
        """Delete the rows of sandboxes killed before `before` (their last update), with
        their events, and idempotency keys claimed before it; the counts. `dry_run`:
        count only."""
        gone = "SELECT id FROM sandboxes WHERE state = ? AND updated_at < ?"
        args = (SandboxState.KILLED.value, before)
        with self._tx() as db:
            counts = {
                "sandboxes": db.execute(f"SELECT COUNT(*) FROM ({gone})", args).fetchone()[0],
                "events": db.execute(f"SELECT COUNT(*) FROM events WHERE sandbox_id IN ({gone})",
                                     args).fetchone()[0],
                "idempotency": db.execute("SELECT COUNT(*) FROM idempotency WHERE created_at < ?",
                                          (before,)).fetchone()[0]}
            if not dry_run:
                db.execute(f"DELETE FROM events WHERE sandbox_id IN ({gone})", args)
                db.execute(f"DELETE FROM sandboxes WHERE id IN ({gone})", args)
                db.execute("DELETE FROM idempotency WHERE created_at < ?", (before,))
        return {k: int(v) for k, v in counts.items()}

    # ---- snapshots -------------------------------------------------------------------
    def insert_snapshot(self, snap: SnapshotRecord) -> SnapshotRecord:
        with self._tx() as db:
            self._insert_snapshot(db, snap)
        return snap

    @staticmethod
    def _insert_snapshot(db: sqlite3.Connection, snap: SnapshotRecord) -> None:
        names = [f.name for f in fields(SnapshotRecord)]
        db.execute(
            f"INSERT OR REPLACE INTO snapshots ({', '.join(names)}) "
            f"VALUES ({', '.join('?' * len(names))})",
            [_encode(n, getattr(snap, n)) for n in names],
        )

    def get_snapshot(self, snapshot_id: str) -> SnapshotRecord:
        row = self._db.execute("SELECT * FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
        if row is None:
            raise SnapshotNotFound(snapshot_id)
        return _decode_row(SnapshotRecord, row)

    def list_snapshots(self, *, sandbox_id: str | None = None,
                       kinds: Iterable[str] | None = None) -> list[SnapshotRecord]:
        sql, args = "SELECT * FROM snapshots WHERE 1=1", []
        if sandbox_id is not None:
            sql += " AND sandbox_id = ?"
            args.append(sandbox_id)
        if kinds is not None:
            k = list(kinds)
            sql += f" AND kind IN ({', '.join('?' * len(k))})"
            args += k
        rows = self._db.execute(sql + " ORDER BY created_at", args).fetchall()
        return [_decode_row(SnapshotRecord, r) for r in rows]

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._tx() as db:
            cur = db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
            if cur.rowcount == 0:
                raise SnapshotNotFound(snapshot_id)

    # ---- events ----------------------------------------------------------------------
    def _event(self, db: sqlite3.Connection, sandbox_id: str, kind: str, detail: dict) -> None:
        db.execute("INSERT INTO events (sandbox_id, kind, ts, detail) VALUES (?, ?, ?, ?)",
                   (sandbox_id, kind, time.time(), json.dumps(detail, sort_keys=True)))

    def add_event(self, sandbox_id: str, kind: str, detail: dict[str, Any] | None = None) -> None:
        with self._tx() as db:
            self._event(db, sandbox_id, kind, detail or {})

    def events(self, sandbox_id: str | None = None, *, after_seq: int = 0,
               limit: int = 1000) -> list[Event]:
        if sandbox_id is None:
            rows = self._db.execute("SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (after_seq, limit)).fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM events WHERE sandbox_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (sandbox_id, after_seq, limit)).fetchall()
        return [_decode_row(Event, r) for r in rows]

    # ---- idempotency -----------------------------------------------------------------
    def claim_idempotency_key(self, key: str, request: str) -> tuple[bool, str | None, str]:
        """Record `key` for `request`. Returns (new, sandbox_id, stored_request)."""
        with self._tx() as db:
            row = db.execute("SELECT request, sandbox_id FROM idempotency WHERE key = ?",
                             (key,)).fetchone()
            if row is not None:
                return False, row["sandbox_id"], row["request"]
            db.execute("INSERT INTO idempotency VALUES (?, ?, NULL, ?)", (key, request, time.time()))
            return True, None, request

    def bind_idempotency_key(self, key: str, sandbox_id: str | None) -> None:
        with self._tx() as db:
            if sandbox_id is None:
                db.execute("DELETE FROM idempotency WHERE key = ?", (key,))
            else:
                db.execute("UPDATE idempotency SET sandbox_id = ? WHERE key = ?", (sandbox_id, key))
