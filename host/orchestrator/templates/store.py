"""SQLite state of template builds: templates, their aliases, builds, build logs, tags and
the uploaded COPY archives. Lives in the node's `Store` database, on its connection and
thread (its tables are created at open with `IF NOT EXISTS`, so an older database gains
them untouched).

Build status moves `waiting -> building -> ready | error` through conditional updates
(`start_build`, `finish_build`), like `Store.transition`; a build that turns ready points
its tags at itself in the same transaction.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AliasConflict, BuildNotFound, InvalidRequest, TemplateNotFound
from ..store import Store

WAITING, BUILDING, READY, ERROR = "waiting", "building", "ready", "error"
IMPORTED = "imported"   # a build's spec: it came from the cluster's catalog, not built here
LEVELS = ("debug", "info", "warn", "error")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS templates (
    id              TEXT PRIMARY KEY,
    public          INTEGER NOT NULL DEFAULT 0,
    cpu_count       INTEGER NOT NULL,
    memory_mb       INTEGER NOT NULL,
    disk_mb         INTEGER NOT NULL,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL,
    spawn_count     INTEGER NOT NULL DEFAULT 0,
    last_spawned_at REAL
);
CREATE TABLE IF NOT EXISTS template_aliases (
    alias        TEXT PRIMARY KEY,
    template_id  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS template_builds (
    id           TEXT PRIMARY KEY,       -- a UUID
    template_id  TEXT NOT NULL,
    status       TEXT NOT NULL,          -- waiting | building | ready | error
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL,
    finished_at  REAL,
    cpu_count    INTEGER NOT NULL,
    memory_mb    INTEGER NOT NULL,
    disk_mb      INTEGER NOT NULL,
    tags         TEXT NOT NULL,          -- JSON list: pointed at this build once ready
    reason       TEXT,                   -- JSON {message, step} of an error
    snapshot_id  TEXT,                   -- chosen at start, committed once ready
    guest        TEXT,                   -- JSON GuestDefaults of the result
    envd_version TEXT,
    spec         TEXT NOT NULL           -- JSON: what was started (no credentials)
);
CREATE INDEX IF NOT EXISTS template_builds_template ON template_builds(template_id);
CREATE TABLE IF NOT EXISTS template_build_logs (
    build_id  TEXT NOT NULL,
    seq       INTEGER NOT NULL,          -- 0-based: the status endpoint's logsOffset
    ts        REAL NOT NULL,
    level     TEXT NOT NULL,
    message   TEXT NOT NULL,
    step      TEXT,
    PRIMARY KEY (build_id, seq)
);
CREATE TABLE IF NOT EXISTS template_tags (
    template_id  TEXT NOT NULL,
    tag          TEXT NOT NULL,
    build_id     TEXT NOT NULL,
    created_at   REAL NOT NULL,
    PRIMARY KEY (template_id, tag)
);
CREATE TABLE IF NOT EXISTS template_files (
    hash        TEXT PRIMARY KEY,        -- the SDK's filesHash of a COPY step
    size        INTEGER NOT NULL,
    created_at  REAL NOT NULL            -- uploaded or last used (files.present)
);
"""


@dataclass(frozen=True)
class TemplateRecord:
    id: str
    cpu_count: int
    memory_mb: int
    disk_mb: int
    created_at: float
    updated_at: float
    public: bool = False
    spawn_count: int = 0
    last_spawned_at: float | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuildRecord:
    id: str
    template_id: str
    status: str
    created_at: float
    updated_at: float
    cpu_count: int
    memory_mb: int
    disk_mb: int
    tags: tuple[str, ...] = ()
    finished_at: float | None = None
    reason: dict[str, Any] | None = None
    snapshot_id: str | None = None
    guest: dict[str, Any] | None = None
    envd_version: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LogRecord:
    seq: int
    timestamp: float
    level: str
    message: str
    step: str | None = None


@dataclass(frozen=True)
class TagRecord:
    template_id: str
    tag: str
    build_id: str
    created_at: float


def all_imported(builds: Sequence[BuildRecord]) -> bool:
    """Whether these builds of a template all came from the cluster's catalog (its home is
    another node: orchestrator/templates/catalog.py). False for none."""
    return bool(builds) and all(b.spec.get(IMPORTED) for b in builds)


def _build(row: sqlite3.Row) -> BuildRecord:
    def js(v: str | None) -> Any:
        return None if v is None else json.loads(v)
    return BuildRecord(
        id=row["id"], template_id=row["template_id"], status=row["status"],
        created_at=row["created_at"], updated_at=row["updated_at"],
        cpu_count=row["cpu_count"], memory_mb=row["memory_mb"], disk_mb=row["disk_mb"],
        tags=tuple(json.loads(row["tags"])), finished_at=row["finished_at"],
        reason=js(row["reason"]), snapshot_id=row["snapshot_id"], guest=js(row["guest"]),
        envd_version=row["envd_version"], spec=json.loads(row["spec"]))


class TemplateStore:
    """The template tables of `store`'s database. Methods are blocking: async callers
    run them on the store's thread (`Context.db`)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        store.add_schema(_SCHEMA)

    # ---- templates -------------------------------------------------------------------
    def _template(self, row: sqlite3.Row) -> TemplateRecord:
        aliases = [r["alias"] for r in self.store.select(
            "SELECT alias FROM template_aliases WHERE template_id = ? ORDER BY alias",
            (row["id"],))]
        return TemplateRecord(
            id=row["id"], cpu_count=row["cpu_count"], memory_mb=row["memory_mb"],
            disk_mb=row["disk_mb"], created_at=row["created_at"],
            updated_at=row["updated_at"], public=bool(row["public"]),
            spawn_count=row["spawn_count"], last_spawned_at=row["last_spawned_at"],
            aliases=tuple(aliases))

    def get_template(self, template_id: str) -> TemplateRecord:
        rows = self.store.select("SELECT * FROM templates WHERE id = ?", (template_id,))
        if not rows:
            raise TemplateNotFound(f"template '{template_id}' not found")
        return self._template(rows[0])

    def find_template(self, id_or_alias: str) -> TemplateRecord | None:
        """The template with this id, else the one with this alias."""
        rows = self.store.select("SELECT * FROM templates WHERE id = ?", (id_or_alias,))
        if not rows:
            rows = self.store.select(
                "SELECT t.* FROM templates t JOIN template_aliases a ON a.template_id = t.id "
                "WHERE a.alias = ?", (id_or_alias,))
        return self._template(rows[0]) if rows else None

    def list_templates(self) -> list[TemplateRecord]:
        rows = self.store.select("SELECT * FROM templates ORDER BY created_at, id")
        return [self._template(r) for r in rows]

    def request_build(self, *, alias: str, new_template_id: str, build: BuildRecord,
                      ) -> tuple[TemplateRecord, BuildRecord]:
        """Record a waiting build of the template called `alias`, creating that template
        (as `new_template_id`) if there is none. AliasConflict when `alias` is another
        template's id."""
        with self.store.transaction() as db:
            row = db.execute("SELECT template_id FROM template_aliases WHERE alias = ?",
                             (alias,)).fetchone()
            if row is None:
                if db.execute("SELECT 1 FROM templates WHERE id = ?", (alias,)).fetchone():
                    raise AliasConflict(f"Alias '{alias}' is already used")
                template_id = new_template_id
                db.execute("INSERT INTO templates (id, cpu_count, memory_mb, disk_mb, "
                           "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?)",
                           (template_id, build.cpu_count, build.memory_mb, build.disk_mb,
                            build.created_at, build.created_at))
                db.execute("INSERT INTO template_aliases VALUES (?, ?)", (alias, template_id))
            else:
                template_id = row["template_id"]
                db.execute("UPDATE templates SET updated_at = ? WHERE id = ?",
                           (build.created_at, template_id))
            db.execute(
                "INSERT INTO template_builds (id, template_id, status, created_at, updated_at, "
                "cpu_count, memory_mb, disk_mb, tags, spec) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (build.id, template_id, WAITING, build.created_at, build.created_at,
                 build.cpu_count, build.memory_mb, build.disk_mb, json.dumps(list(build.tags)),
                 json.dumps(build.spec)))
        return self.get_template(template_id), self.get_build(build.id)

    def delete_template(self, template_id: str) -> list[BuildRecord]:
        """Forget the template, its aliases, tags, builds and their logs; returns the
        builds (whose snapshots the caller releases)."""
        with self.store.transaction() as db:
            return self._delete_rows(db, template_id)

    @staticmethod
    def _delete_rows(db: sqlite3.Connection, template_id: str) -> list[BuildRecord]:
        """Inside a transaction: the template's rows in every table; its builds."""
        builds = [_build(r) for r in db.execute(
            "SELECT * FROM template_builds WHERE template_id = ?", (template_id,))]
        for table, column in (("template_aliases", "template_id"),
                              ("template_tags", "template_id"),
                              ("template_builds", "template_id"), ("templates", "id")):
            db.execute(f"DELETE FROM {table} WHERE {column} = ?", (template_id,))
        db.executemany("DELETE FROM template_build_logs WHERE build_id = ?",
                       [(b.id,) for b in builds])
        return builds

    def is_imported(self, template_id: str) -> bool:
        """Whether every build of the template came from the cluster's catalog (none was
        built here: orchestrator/templates/catalog.py)."""
        return all_imported(self.list_builds(template_id))

    def import_template(self, tmpl: TemplateRecord, builds: Sequence[BuildRecord],
                        tags: Sequence[TagRecord]) -> bool:
        """Replace this node's copy of another node's template with `tmpl` as the catalog
        has it (in one transaction). False, and nothing changed, when a build of it was
        made here (this node is its home) or the copy is as current already. An alias
        another template of this node holds stays that template's."""
        with self.store.transaction() as db:
            had = [_build(r) for r in db.execute(
                "SELECT * FROM template_builds WHERE template_id = ?", (tmpl.id,))]
            if had and not all_imported(had):
                return False
            row = db.execute("SELECT updated_at FROM templates WHERE id = ?",
                             (tmpl.id,)).fetchone()
            have = {(t["tag"], t["build_id"]) for t in db.execute(
                "SELECT tag, build_id FROM template_tags WHERE template_id = ?", (tmpl.id,))}
            if row is not None and row["updated_at"] == tmpl.updated_at and \
                    have == {(t.tag, t.build_id) for t in tags}:
                return False
            self._delete_rows(db, tmpl.id)
            db.execute("INSERT INTO templates (id, public, cpu_count, memory_mb, disk_mb, "
                       "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (tmpl.id, int(tmpl.public), tmpl.cpu_count, tmpl.memory_mb,
                        tmpl.disk_mb, tmpl.created_at, tmpl.updated_at))
            db.executemany("INSERT OR IGNORE INTO template_aliases VALUES (?, ?)",
                           [(a, tmpl.id) for a in tmpl.aliases])
            for b in builds:
                db.execute(
                    "INSERT OR REPLACE INTO template_builds (id, template_id, status, "
                    "created_at, updated_at, finished_at, cpu_count, memory_mb, disk_mb, "
                    "tags, reason, snapshot_id, guest, envd_version, spec) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (b.id, tmpl.id, b.status, b.created_at, b.updated_at, b.finished_at,
                     b.cpu_count, b.memory_mb, b.disk_mb, json.dumps(list(b.tags)),
                     None if b.reason is None else json.dumps(b.reason), b.snapshot_id,
                     None if b.guest is None else json.dumps(b.guest), b.envd_version,
                     json.dumps(b.spec)))
            db.executemany("INSERT OR REPLACE INTO template_tags VALUES (?, ?, ?, ?)",
                           [(tmpl.id, t.tag, t.build_id, t.created_at) for t in tags])
        return True

    def count_spawn(self, template_id: str, now: float) -> None:
        with self.store.transaction() as db:
            db.execute("UPDATE templates SET spawn_count = spawn_count + 1, "
                       "last_spawned_at = ? WHERE id = ?", (now, template_id))

    # ---- builds ----------------------------------------------------------------------
    def get_build(self, build_id: str) -> BuildRecord:
        rows = self.store.select("SELECT * FROM template_builds WHERE id = ?", (build_id,))
        if not rows:
            raise BuildNotFound(build_id)
        return _build(rows[0])

    def list_builds(self, template_id: str | None = None,
                    statuses: Iterable[str] | None = None) -> list[BuildRecord]:
        sql, args = "SELECT * FROM template_builds WHERE 1=1", []
        if template_id is not None:
            sql += " AND template_id = ?"
            args.append(template_id)
        if statuses is not None:
            st = list(statuses)
            sql += f" AND status IN ({', '.join('?' * len(st))})"
            args += st
        return [_build(r) for r in self.store.select(sql + " ORDER BY created_at, id", args)]

    def start_build(self, build_id: str, *, snapshot_id: str, spec: dict[str, Any],
                    now: float) -> BuildRecord:
        """waiting -> building; InvalidRequest when the build is not waiting."""
        with self.store.transaction() as db:
            cur = db.execute("UPDATE template_builds SET status = ?, snapshot_id = ?, spec = ?, "
                             "updated_at = ? WHERE id = ? AND status = ?",
                             (BUILDING, snapshot_id, json.dumps(spec), now, build_id, WAITING))
            if cur.rowcount == 0:
                if not db.execute("SELECT 1 FROM template_builds WHERE id = ?",
                                  (build_id,)).fetchone():
                    raise BuildNotFound(build_id)
                raise InvalidRequest("build is not in waiting state")
        return self.get_build(build_id)

    def finish_build(self, build_id: str, status: str, *, now: float,
                     reason: dict[str, Any] | None = None, guest: dict[str, Any] | None = None,
                     envd_version: str | None = None,
                     snapshot_id: str | None = None) -> BuildRecord:
        """building -> ready (its tags now point at it) or error. Raises BuildNotFound when
        the build is gone (its template was deleted meanwhile)."""
        with self.store.transaction() as db:
            row = db.execute("SELECT * FROM template_builds WHERE id = ? AND status = ?",
                             (build_id, BUILDING)).fetchone()
            if row is None:
                raise BuildNotFound(build_id)
            build = _build(row)
            db.execute("UPDATE template_builds SET status = ?, finished_at = ?, updated_at = ?, "
                       "reason = ?, guest = ?, envd_version = ?, snapshot_id = ? WHERE id = ?",
                       (status, now, now, None if reason is None else json.dumps(reason),
                        None if guest is None else json.dumps(guest), envd_version,
                        snapshot_id or build.snapshot_id, build_id))
            if status == READY:
                self._point(db, build.template_id, build_id, build.tags, now)
                db.execute("UPDATE templates SET cpu_count = ?, memory_mb = ?, disk_mb = ?, "
                           "updated_at = ? WHERE id = ?", (build.cpu_count, build.memory_mb,
                                                           build.disk_mb, now, build.template_id))
        return self.get_build(build_id)

    def fail_unfinished(self, message: str, now: float) -> list[BuildRecord]:
        """Every `building` build -> error with `message` (recovery after a restart)."""
        reason = json.dumps({"message": message})
        with self.store.transaction() as db:
            rows = [_build(r) for r in db.execute(
                "SELECT * FROM template_builds WHERE status = ?", (BUILDING,))]
            db.execute("UPDATE template_builds SET status = ?, reason = ?, finished_at = ?, "
                       "updated_at = ? WHERE status = ?", (ERROR, reason, now, now, BUILDING))
        return rows

    # ---- build logs ------------------------------------------------------------------
    def append_logs(self, build_id: str, first_seq: int,
                    entries: Sequence[LogRecord]) -> None:
        with self.store.transaction() as db:
            db.executemany("INSERT OR REPLACE INTO template_build_logs VALUES (?,?,?,?,?,?)",
                           [(build_id, first_seq + i, e.timestamp, e.level, e.message, e.step)
                            for i, e in enumerate(entries)])

    def logs(self, build_id: str) -> list[LogRecord]:
        rows = self.store.select("SELECT * FROM template_build_logs WHERE build_id = ? "
                                 "ORDER BY seq", (build_id,))
        return [LogRecord(seq=r["seq"], timestamp=r["ts"], level=r["level"],
                          message=r["message"], step=r["step"]) for r in rows]

    # ---- tags ------------------------------------------------------------------------
    def tags(self, template_id: str) -> list[TagRecord]:
        rows = self.store.select("SELECT * FROM template_tags WHERE template_id = ? "
                                 "ORDER BY tag", (template_id,))
        return [TagRecord(r["template_id"], r["tag"], r["build_id"], r["created_at"])
                for r in rows]

    def tag(self, template_id: str, tag: str) -> TagRecord | None:
        return next((t for t in self.tags(template_id) if t.tag == tag), None)

    @staticmethod
    def _point(db: sqlite3.Connection, template_id: str, build_id: str,
               tags: Iterable[str], now: float) -> None:
        db.executemany("INSERT OR REPLACE INTO template_tags VALUES (?, ?, ?, ?)",
                       [(template_id, t, build_id, now) for t in tags])

    def assign_tags(self, template_id: str, build_id: str, tags: Sequence[str],
                    now: float) -> None:
        with self.store.transaction() as db:
            self._point(db, template_id, build_id, tags, now)

    def remove_tags(self, template_id: str, tags: Sequence[str]) -> None:
        with self.store.transaction() as db:
            db.executemany("DELETE FROM template_tags WHERE template_id = ? AND tag = ?",
                           [(template_id, t) for t in tags])

    # ---- uploaded COPY archives ------------------------------------------------------
    def add_file(self, files_hash: str, size: int, now: float | None = None) -> None:
        with self.store.transaction() as db:
            db.execute("INSERT OR REPLACE INTO template_files VALUES (?, ?, ?)",
                       (files_hash, size, time.time() if now is None else now))

    def use_file(self, files_hash: str, now: float) -> bool:
        """Whether the archive is recorded; if so its time becomes `now` (in one statement:
        an expiry either saw the old time and removed the row first, or sees the new)."""
        with self.store.transaction() as db:
            return db.execute("UPDATE template_files SET created_at = ? WHERE hash = ?",
                              (now, files_hash)).rowcount > 0

    def expire_files(self, before: float, *, dry_run: bool = False) -> list[tuple[str, int]]:
        """The archives (hash, size) unused since `before`, their rows removed unless
        `dry_run`; none while a build runs, or waits for its start (it may COPY any;
        one requested before `before` and never started does not count)."""
        with self.store.transaction() as db:
            if db.execute("SELECT 1 FROM template_builds WHERE status = ? OR "
                          "(status = ? AND updated_at >= ?) LIMIT 1",
                          (BUILDING, WAITING, before)).fetchone():
                return []
            rows = [(str(r[0]), int(r[1])) for r in db.execute(
                "SELECT hash, size FROM template_files WHERE created_at < ?", (before,))]
            if not dry_run:
                db.executemany("DELETE FROM template_files WHERE hash = ?",
                               [(h,) for h, _ in rows])
            return rows
