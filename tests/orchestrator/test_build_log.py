"""BuildLogBuffer's bounds: what a build's commands print is the guest's choice, so one
build's log holds at most MAX_ENTRIES entries and MAX_CHARS characters, each entry at
most MAX_MESSAGE (issue 28 item 2)."""

from __future__ import annotations

from host.orchestrator.templates.build_log import (
    MAX_CHARS,
    MAX_ENTRIES,
    MAX_MESSAGE,
    BuildLogBuffer,
)


def test_long_entries_stop_at_the_total_with_one_warning() -> None:
    log = BuildLogBuffer(lambda: 0.0)
    for _ in range(MAX_ENTRIES):
        log("info", "x" * (MAX_MESSAGE * 4), "1")   # each kept as MAX_MESSAGE characters
    kept = log.entries[:-1]
    assert len(kept) == MAX_CHARS // (MAX_MESSAGE + len(" [truncated]"))
    assert sum(len(e.message) for e in kept) <= MAX_CHARS
    assert log.entries[-1].level == "warn"
    assert log.entries[-1].message.startswith(f"build log truncated at {len(kept)} entries")
    log("info", "later", "2")
    assert log.entries[-1].level == "warn"  # nothing after the warning


def test_short_entries_stop_at_the_entry_count() -> None:
    log = BuildLogBuffer(lambda: 0.0)
    for i in range(MAX_ENTRIES + 5):
        log("info", f"line {i}", "1")
    assert len(log.entries) == MAX_ENTRIES + 1
    assert log.entries[-1].message.startswith(f"build log truncated at {MAX_ENTRIES} entries")
