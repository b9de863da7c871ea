"""A small in-process `SandboxRuntime` test double and a fake envd (httpx MockTransport).

Allowed ONLY for unit tests of the orchestrator's state-machine logic (transitions,
conflicts, serialization, TTLs, recovery decisions, idempotency, fork bookkeeping,
events). No VM runs; the VM-backed behaviour is tested in test_node_vm.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

from host.contract import (
    Balloon,
    BuildFailed,
    BuildLog,
    BuildSpec,
    MachineSpec,
    Placement,
    Reclaim,
    SnapshotRef,
)
from host.orchestrator.model import NetworkConfig


class RuntimeFailure(RuntimeError):
    pass


class FakeRuntime:
    """Keeps "VMs" (placements) and snapshots in dicts. Knobs: `fail` maps an operation
    name to a predicate on the sandbox id (True = raise); `gates` maps an operation name to
    an Event the operation waits for; `calls` records (op, args) in order."""

    def __init__(self) -> None:
        self.vms: dict[str, Placement] = {}
        self.snapshots: dict[str, SnapshotRef] = {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fanouts: list[int] = []  # each start's fanout (a fork passes its count)
        self.listening: dict[str, int] = {}    # listen(): sandbox id -> loopback port
        self.fail: dict[str, Callable[[str], bool]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}
        self.builds = 0
        self.adoptable: set[str] | None = None  # None: every VM in `vms` survives a restart
        self.envd: FakeEnvd | None = None  # set: snapshots keep the token envd held
        self.held: dict[str, str | None] = {}
        self.reboots: list[str] = []  # sandboxes cold-booted (filesystem-only resume)
        self.memory_flags: list[bool] = []  # `memory` of each snapshot call
        # per snapshot call: what its `reclaim` said the guest freed (None: no reclaim)
        self.reclaimed: list[int | None] = []
        self.dead: set[str] = set()  # VMs that "exited by themselves" (exited())
        self.warm: set[str] = set()  # held VMs (start(hold=True)) not continued yet
        self.build_specs: list[BuildSpec] = []  # every build() call's spec, in order
        self.disks: set[str] = set()  # dead sandboxes whose disk survived (salvage())
        # shared documents (the repository's, shared by the nodes of a cluster test:
        # give two runtimes the same dict, as they would share one repository)
        self.documents: dict[str, dict[str, Any]] = {}
        self.answer_on_stop = False  # call snapshot's `stopped` (as the real runtime)
        self.balloons: dict[str, int] = {}  # MiB each VM's balloon holds (set at once)
        self.spare: dict[str, int] = {}  # what each guest reports it could spare (unset:
        #                                  no report yet)
        self.caches: dict[str, int] = {}  # how much of that is page cache (unset: all)
        self._n = itertools.count(1)

    async def _step(self, op: str, sandbox_id: str) -> None:
        self.entered.setdefault(op, asyncio.Event()).set()
        gate = self.gates.get(op)
        if gate is not None:
            await gate.wait()
        pred = self.fail.get(op)
        if pred is not None and pred(sandbox_id):
            raise RuntimeFailure(f"{op} of {sandbox_id} failed (injected)")

    async def build_template(self, template_id: str, machine: MachineSpec) -> SnapshotRef:
        self.calls.append(("build_template", (template_id,)))
        await self._step("build_template", template_id)
        await asyncio.sleep(0.05)  # long enough for concurrent creates to pile up
        self.builds += 1
        ref = SnapshotRef(snapshot_id=f"tmpl-{template_id}", machine=machine,
                          created_at=time.time())
        self.snapshots[ref.snapshot_id] = ref
        return ref

    async def build(self, spec: BuildSpec, log: BuildLog) -> SnapshotRef:
        """Records the spec, logs a line per phase and step, folds USER / WORKDIR / ENV
        into `facts["guest"]` (starting from the source snapshot's), and fails a step
        whose args contain "exit 1" (BuildFailed, like a real non-zero exit) or a COPY
        whose archive is not in `files_dir`."""
        self.calls.append(("build", (spec.snapshot_id,)))
        self.build_specs.append(spec)
        await self._step("build", spec.snapshot_id)
        guest: dict[str, Any] = {"user": "user", "workdir": "/home/user", "env": {}}
        if spec.from_snapshot is not None:
            source = self.snapshots.get(spec.from_snapshot)
            if source is None:
                raise BuildFailed(f"no snapshot {spec.from_snapshot}", step="base")
            guest.update(source.facts.get("guest") or {})
            guest["env"] = dict(guest["env"])
        log("info", f"FROM {spec.from_image or spec.from_snapshot or spec.machine.image}",
            "base")
        for i, step in enumerate(spec.steps, 1):
            log("info", f"{step.type} {' '.join(step.args)}", str(i))
            await asyncio.sleep(0)
            if any("exit 1" in a for a in step.args):
                log("error", "exit status 1", str(i))
                raise BuildFailed(f"Command '{step.args[0]}' failed with exit code 1",
                                  step=str(i))
            if step.type == "COPY" and not (spec.files_dir and step.files_hash and (
                    spec.files_dir / step.files_hash).is_file()):
                raise BuildFailed(f"no archive for {step.files_hash}", step=str(i))
            if step.type == "USER":
                guest["user"] = step.args[0]
            elif step.type == "WORKDIR":
                guest["workdir"] = step.args[0]
            elif step.type == "ENV":
                guest["env"].update(zip(step.args[::2], step.args[1::2], strict=True))
        if spec.start_cmd:
            log("info", f"start: {spec.start_cmd}", "finalize")
        if spec.ready_cmd:
            log("debug", f"ready: {spec.ready_cmd}", "finalize")
        ref = SnapshotRef(snapshot_id=spec.snapshot_id, machine=spec.machine,
                          created_at=time.time(), parent_id=spec.from_snapshot,
                          facts={"guest": guest, "build": {"steps": len(spec.steps)}})
        self.snapshots[ref.snapshot_id] = ref
        return ref

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, hold: bool = False, fanout: int = 1) -> Placement:
        self.calls.append(("start", (sandbox_id, snapshot.snapshot_id)))
        self.fanouts.append(fanout)
        cold = reboot or snapshot.facts.get("memory", True) is None
        await self._step("start", sandbox_id)
        if sandbox_id in self.warm and not hold:  # continue its held VM
            self.warm.discard(sandbox_id)
            if self.vms[sandbox_id].facts.get("from") == snapshot.snapshot_id:
                return self.vms[sandbox_id]
        if snapshot.snapshot_id not in self.snapshots:
            raise RuntimeFailure(f"no snapshot {snapshot.snapshot_id}")
        n = next(self._n)
        p = Placement(sandbox_id=sandbox_id, envd_host=f"10.9.{n // 250}.{n % 250 + 1}",
                      envd_port=49983, facts={"vm": n, "from": snapshot.snapshot_id})
        self.vms[sandbox_id] = p
        if hold:
            self.warm.add(sandbox_id)
        self.dead.discard(sandbox_id)  # a new VM
        if cold:
            self.reboots.append(sandbox_id)
        token = None if cold else self.held.get(snapshot.snapshot_id)  # a fresh envd: none
        if self.envd is not None and token:
            self.envd.tokens[p.envd_host] = token
        return p

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True, stopped: Callable[[], None] | None = None,
                       keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
        self.calls.append(("snapshot", (sandbox_id, snapshot_id, stop)))
        # always asked (a real runtime asks only a guest with enough private memory)
        self.reclaimed.append(await reclaim() if reclaim is not None else None)
        self.memory_flags.append(memory)
        if stop and stopped is not None and self.answer_on_stop and sandbox_id in self.vms:
            stopped()
        await self._step("snapshot", sandbox_id)
        vm = self.vms.get(sandbox_id)
        if vm is None:
            raise RuntimeFailure(f"no VM {sandbox_id}")
        ref = SnapshotRef(snapshot_id=snapshot_id, machine=MachineSpec(), created_at=time.time(),
                          parent_id=vm.facts.get("from"),
                          facts={} if memory else {"memory": None})
        self.snapshots[snapshot_id] = ref
        if self.envd is not None:
            self.held[snapshot_id] = self.envd.tokens.get(vm.envd_host)
        if stop and keep and memory:  # kept, stopped: a start from this snapshot continues it
            self.vms[sandbox_id] = dataclasses.replace(
                vm, facts={**vm.facts, "from": snapshot_id})
            self.warm.add(sandbox_id)
        elif stop:
            del self.vms[sandbox_id]
        return ref

    def exited(self) -> list[str]:
        return sorted(self.dead & set(self.vms))

    async def balloon(self, sandbox_id: str) -> Balloon | None:
        if sandbox_id not in self.vms:
            raise RuntimeFailure(f"no sandbox {sandbox_id}")
        size = self.balloons.get(sandbox_id, 0)
        spare = self.spare.get(sandbox_id)
        left = None if spare is None else max(0, spare - size)
        cache = self.caches.get(sandbox_id, left)  # unset: all it can spare is cache
        return Balloon(size_mib=size, target_mib=size, available_mib=left, caches_mib=cache)

    async def set_balloon(self, sandbox_id: str, amount_mib: int) -> None:
        self.calls.append(("set_balloon", (sandbox_id, amount_mib)))
        await self._step("set_balloon", sandbox_id)
        if sandbox_id not in self.vms:
            raise RuntimeFailure(f"no sandbox {sandbox_id}")
        self.balloons[sandbox_id] = amount_mib

    async def kill(self, sandbox_id: str) -> None:
        self.calls.append(("kill", (sandbox_id,)))
        await self._step("kill", sandbox_id)
        self.vms.pop(sandbox_id, None)
        self.warm.discard(sandbox_id)

    async def adopt(self, sandbox_id: str, facts: dict[str, Any]) -> Placement | None:
        self.calls.append(("adopt", (sandbox_id,)))
        vm = self.vms.get(sandbox_id)
        if vm is None or (self.adoptable is not None and sandbox_id not in self.adoptable):
            self.vms.pop(sandbox_id, None)
            return None
        return vm

    async def salvage(self, sandbox_id: str, facts: dict[str, Any],
                      snapshot_id: str) -> SnapshotRef | None:
        """A dead sandbox's disk kept as a disk-only snapshot, for those in `disks`."""
        self.calls.append(("salvage", (sandbox_id, snapshot_id)))
        if sandbox_id not in self.disks:
            return None
        self.disks.discard(sandbox_id)
        ref = SnapshotRef(snapshot_id=snapshot_id, machine=MachineSpec(), created_at=0.0,
                          parent_id=str(facts.get("from")), facts={"memory": None})
        self.snapshots[snapshot_id] = ref
        return ref

    async def reap_orphans(self, known: set[str]) -> list[str]:
        self.calls.append(("reap_orphans", (frozenset(known),)))
        gone = [sid for sid in self.vms if sid not in known]
        for sid in gone:
            del self.vms[sid]
        return gone

    async def find_snapshot(self, snapshot_id: str) -> SnapshotRef | None:
        return self.snapshots.get(snapshot_id)

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        self.calls.append(("update_network", (sandbox_id, network)))

    async def listen(self, sandbox_id: str) -> socket.socket:
        """A loopback socket standing in for the guest's gateway (no namespace): its
        port in `listening`, where a test connects as the guest would."""
        self.calls.append(("listen", (sandbox_id,)))
        sock = socket.create_server(("127.0.0.1", 0))
        sock.setblocking(False)
        self.listening[sandbox_id] = sock.getsockname()[1]
        return sock

    async def delete_snapshot(self, snapshot_id: str) -> None:
        self.calls.append(("delete_snapshot", (snapshot_id,)))
        self.snapshots.pop(snapshot_id, None)

    async def put_document(self, name: str, doc: dict[str, Any]) -> None:
        await self._step("put_document", name)
        self.documents[name] = json.loads(json.dumps(doc))  # as stored: JSON only

    async def get_document(self, name: str) -> dict[str, Any] | None:
        return self.documents.get(name)

    async def delete_document(self, name: str) -> None:
        self.documents.pop(name, None)

    @property
    def handoffs(self) -> dict[str, dict[str, Any]]:
        """The handoff documents by sandbox id (a view: the same inner dicts)."""
        return {k.removeprefix("handoff-"): v for k, v in self.documents.items()
                if k.startswith("handoff-")}

    async def console_log(self, sandbox_id: str, limit: int = 1000) -> list[str]:
        return [f"console of {sandbox_id}"]

    async def collect_storage(self, *, dry_run: bool = False) -> dict[str, Any]:
        self.calls.append(("collect_storage", (dry_run,)))
        return {"memory": {"files": 0, "bytes": 0, "digests": []}, "held": {"memory": 0},
                "dry_run": dry_run}

    async def aclose(self) -> None:
        pass

    def ops(self, name: str) -> list[tuple[Any, ...]]:
        return [args for op, args in self.calls if op == name]


class FakeEnvd:
    """envd's /init and /metrics per guest address, with envd's token rule: once a token
    is set, a re-init must carry it. `tokens` maps host -> token; `inits` records
    (host, body, headers)."""

    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}
        self.inits: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.fail_hosts: set[str] = set()
        self.stopped_hosts: set[str] = set()
        self.syncs: list[tuple[str, str, str]] = []  # (host, cmd, authorization)
        self.sync_fails: set[str] = set()
        self.sync_exit: dict[str, int] = {}   # host -> /bin/sync's exit code (default 0)
        self.reclaims: list[str] = []  # hosts asked to drop their page cache
        # host -> what /aenv/reclaim answers: MiB freed (default 0), or a Response
        self.freed: dict[str, int | httpx.Response] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/health":  # no auth; a VM with stopped vCPUs never answers
            if host in self.stopped_hosts:
                raise httpx.ConnectTimeout("stopped", request=request)
            return httpx.Response(204)
        if host in self.fail_hosts:
            return httpx.Response(500, json={"code": 500, "message": "injected"})
        held = self.tokens.get(host)
        given = request.headers.get("x-access-token")
        if held is not None and given != held:
            return httpx.Response(401, json={"code": 401, "message": "bad token"})
        if request.url.path == "/init":
            body = json.loads(request.content)
            self.inits.append((host, body, dict(request.headers)))
            if body.get("accessToken"):
                self.tokens[host] = body["accessToken"]
            return httpx.Response(204)
        if request.url.path == "/process.Process/Start":  # the host's /bin/sync
            req = request.content
            cmd = json.loads(req[5:5 + int.from_bytes(req[1:5], "big")])["process"]["cmd"]
            self.syncs.append((host, cmd, request.headers.get("authorization", "")))
            end = json.dumps({"error": {"code": "unavailable", "message": "no"}}
                             if host in self.sync_fails else {}).encode()
            start = json.dumps({"event": {"start": {"pid": 7}}}).encode()
            code = self.sync_exit.get(host, 0)   # what /bin/sync exits with
            done = json.dumps({"event": {"end": {
                "exitCode": code, "exited": True, "status": f"exit status {code}",
                **({"error": f"exit status {code}"} if code else {})}}}).encode()
            frames = b"\0" + len(start).to_bytes(4, "big") + start
            if host not in self.sync_fails:
                frames += b"\0" + len(done).to_bytes(4, "big") + done
            return httpx.Response(200, headers={"content-type": "application/connect+json"},
                                  content=frames + b"\2" + len(end).to_bytes(4, "big") + end)
        if request.url.path == "/aenv/reclaim" and request.method == "POST":
            self.reclaims.append(host)
            freed = self.freed.get(host, 0)
            if isinstance(freed, httpx.Response):
                return freed
            return httpx.Response(200, json={"freedMiB": freed, "freeMiB": freed + 50})
        if request.url.path == "/metrics":
            return httpx.Response(200, json={"ts": 1_700_000_000, "cpu_count": 2,
                                             "cpu_used_pct": 3.5, "mem_total": 10,
                                             "mem_used": 4, "mem_cache": 1, "disk_used": 5,
                                             "disk_total": 20})
        return httpx.Response(404)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


class Clock:
    """A settable clock for TTL tests."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s
