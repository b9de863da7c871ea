"""Structured logs: `setup_logging(..., "json")` writes one JSON object per line with ts,
level, logger, msg and the sandbox id, which comes from the orchestrator's operation
context (records logged at any depth inside an operation) or from the record's
arguments; the `--log-format` / `--metrics` settings."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from host.config import ConfigError, parse_config
from host.contract import NetworkConfig, Placement, Reclaim, SnapshotRef
from host.metrics import Metrics, bind_sandbox, sandbox_context, setup_logging
from host.metrics.logs import _SANDBOX_ID
from host.orchestrator import NodeOrchestrator, Store, ids
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import CreateRequest
from tests.orchestrator.fakes import FakeEnvd, FakeRuntime

VM_LOG = logging.getLogger("tests.metrics.vm")


class Logs:
    """The root handler `setup_logging` installed, writing into a buffer."""

    def __init__(self, log_format: str) -> None:
        self.buf = io.StringIO()
        self.handler = setup_logging("debug", log_format, stream=self.buf)

    def lines(self) -> list[str]:
        return self.buf.getvalue().splitlines()

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines()]  # every line is one object


@pytest.fixture
def json_logs() -> Iterator[Logs]:
    root = logging.getLogger()
    level = root.level
    logs = Logs("json")
    try:
        yield logs
    finally:
        root.removeHandler(logs.handler)
        root.setLevel(level)


def test_json_lines_with_the_sandbox_of_the_context(json_logs: Logs) -> None:
    log = logging.getLogger("host.test")
    sid = ids.new_sandbox_id()
    log.info("outside")
    with sandbox_context(sid):
        log.warning("inside %d", 42)
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")
    log.debug("after")
    outside, inside, failed, after = json_logs.records()
    assert set(outside) == {"ts", "level", "logger", "msg"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", outside["ts"])
    assert inside == {"ts": inside["ts"], "level": "warning", "logger": "host.test",
                      "msg": "inside 42", "sandbox_id": sid}
    assert failed["sandbox_id"] == sid
    assert failed["exc"].startswith("Traceback") and "ValueError: bad" in failed["exc"]
    assert "sandbox_id" not in after


def test_sandbox_id_from_the_record_arguments(json_logs: Logs,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    log = logging.getLogger("uvicorn.access")
    # as the service runs it in json mode (uvicorn's log_config=None); a uvicorn server
    # started by an earlier test in this process gave it its own handler and level
    for logger in (log, logging.getLogger("uvicorn")):
        for name, value in (("propagate", True), ("disabled", False), ("handlers", []),
                            ("level", logging.NOTSET)):
            monkeypatch.setattr(logger, name, value)
    log.setLevel(logging.NOTSET)  # also clears the loggers' cached effective levels
    sid = ids.new_sandbox_id()
    log.info("sandbox %s: its VM exited on its own", sid)
    log.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "POST", f"/sandboxes/{sid}/pause",
             "1.1", 204)
    log.info("template %s", ids.new_sandbox_id()[1:])  # 20 chars: a template id, not one
    log.info("word %s", "i" + "x" * 25)
    by_args, access, template, word = json_logs.records()
    assert by_args["sandbox_id"] == sid
    assert access["sandbox_id"] == sid
    assert access["msg"] == f'127.0.0.1:5 - "POST /sandboxes/{sid}/pause HTTP/1.1" 204'
    assert "sandbox_id" not in template and "sandbox_id" not in word


def test_the_argument_pattern_is_the_orchestrators_sandbox_id() -> None:
    for _ in range(50):
        sid = ids.new_sandbox_id()
        assert ids.SANDBOX_ID.match(sid)
        assert _SANDBOX_ID.search(sid) and _SANDBOX_ID.search(f"/sandboxes/{sid}?x=1")
    assert ids.SANDBOX_ID.pattern.strip("^$") in _SANDBOX_ID.pattern


def test_text_format_is_the_classic_one() -> None:
    root = logging.getLogger()
    level = root.level
    logs = Logs("text")
    try:
        logging.getLogger("host.test").info("hello %s", "world")
    finally:
        root.removeHandler(logs.handler)
        root.setLevel(level)
    (line,) = logs.lines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d [\d:,]+ INFO host\.test: hello world", line)


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "yaml")


class LoggingRuntime(FakeRuntime):
    """Logs from inside the runtime, as the real one does, without naming the sandbox."""

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, **kwargs: Any) -> Placement:
        VM_LOG.info("restoring a VM")
        return await super().start(sandbox_id, snapshot, network, reboot=reboot, **kwargs)

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True, stopped: Callable[[], None] | None = None,
                       keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
        VM_LOG.info("writing a snapshot")
        return await super().snapshot(sandbox_id, snapshot_id, stop=stop, memory=memory,
                                      stopped=stopped, keep=keep, reclaim=reclaim)

    async def kill(self, sandbox_id: str) -> None:
        VM_LOG.info("stopping a VM")
        await super().kill(sandbox_id)


async def test_orchestrator_operations_tag_their_records(json_logs: Logs,
                                                         tmp_path: Path) -> None:
    rt = LoggingRuntime()
    rt.envd = envd = FakeEnvd()
    store = Store(tmp_path / "state.db")
    orch = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()),
                            metrics=Metrics())
    await orch.start(ttl_interval_s=3600)
    try:
        a = (await orch.create(CreateRequest())).sandbox_id
        b = (await orch.create(CreateRequest())).sandbox_id
        await orch.pause(a)
        await orch.connect(a, 60)
        await orch.kill(b)
        VM_LOG.info("between operations")
    finally:
        await orch.aclose(grace_s=5)
        store.close()
    vm = [(r["msg"], r.get("sandbox_id")) for r in json_logs.records()
          if r["logger"] == VM_LOG.name]
    assert vm == [("restoring a VM", a), ("restoring a VM", b), ("writing a snapshot", a),
                  ("restoring a VM", a), ("stopping a VM", b),
                  ("between operations", None)]


def test_bind_sandbox_lasts_until_the_scope_ends(json_logs: Logs) -> None:
    log = logging.getLogger("host.test")
    sid = ids.new_sandbox_id()
    with sandbox_context(None):
        bind_sandbox(sid)  # a create learns its id half-way
        log.info("created")
    log.info("later")
    created, later = json_logs.records()
    assert created["sandbox_id"] == sid and "sandbox_id" not in later


# ---- settings --------------------------------------------------------------------------

def test_log_format_and_metrics_settings() -> None:
    cfg = parse_config([], env={})
    assert (cfg.log_format, cfg.metrics) == ("text", True)
    cfg = parse_config(["--log-format", "json", "--no-metrics"], env={})
    assert (cfg.log_format, cfg.metrics) == ("json", False)
    cfg = parse_config([], env={"AENV_LOG_FORMAT": "json", "AENV_METRICS": "off"})
    assert (cfg.log_format, cfg.metrics) == ("json", False)
    cfg = parse_config(["--metrics"], env={"AENV_METRICS": "0"})  # flags win
    assert cfg.metrics is True
    with pytest.raises(ConfigError, match="log_format"):
        parse_config([], env={"AENV_LOG_FORMAT": "xml"})
    with pytest.raises(SystemExit):
        parse_config(["--log-format", "xml"], env={})
