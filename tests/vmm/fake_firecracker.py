"""A stand-in `firecracker` executable for the driver tests (no real Firecracker here).

Run as `fake_firecracker.py --api-sock PATH [--log-path PATH]`: serves a tiny HTTP/1.1 API on the unix
socket that validates every request against `firecracker_api_schema` (method, path,
body; path ids must match body ids), simulates the state rules Firecracker documents and
answers 204/200 or 400 {"fault_message": ...} like the real one:

- pre-boot resources (machine-config, boot-source, drives, network-interfaces, balloon)
  only before InstanceStart; kernel and drive files must exist; one root drive;
- InstanceStart only once and only after boot-source;
- PATCH /vm only after start; PUT /snapshot/create only while Paused;
- PUT /snapshot/load only on a fresh process (nothing configured); the snapshot and
  memory files and the saved drive paths must exist; PATCH /drives only after start.

Environment knobs (inherited through the driver's spawn):
  FAKE_FC_LOG      append one JSON line per request: method, path, body, status
  FAKE_FC_MODE     "never-listen": run without opening the socket; "exit": exit 3 at once
  FAKE_FC_FAIL     "METHOD PATH": answer that request with 400 and an injected fault
  FAKE_FC_CRASH    "METHOD PATH": exit with code 9 on receiving that request
  FAKE_FC_HANG     "METHOD PATH": never answer that request
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script: make the repo root importable for the schema module.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jsonschema  # type: ignore[import-untyped]

from tests.vmm.firecracker_api_schema import PATH_ID_FIELDS, match

PRE_BOOT = {"/machine-config", "/boot-source", r"/drives/([^/]+)",
            r"/network-interfaces/([^/]+)", "/balloon"}


class Fault(Exception):
    pass


class FakeFirecracker:
    def __init__(self) -> None:
        self.state = "Not started"
        self.machine: dict[str, Any] = {"vcpu_count": 1, "mem_size_mib": 128,
                                        "track_dirty_pages": False}
        self.boot: dict[str, Any] | None = None
        self.drives: dict[str, dict[str, Any]] = {}
        self.ifaces: dict[str, dict[str, Any]] = {}
        self.balloon: dict[str, Any] | None = None
        self.configured = False
        self.log = os.environ.get("FAKE_FC_LOG")
        self.fail = os.environ.get("FAKE_FC_FAIL")

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        try:
            return 200, self._handle(method, path, body)
        except Fault as exc:
            return 400, {"fault_message": str(exc)}

    def _handle(self, method: str, path: str, body: Any) -> Any:
        found = match(method, path)
        if found is None:
            raise Fault(f"Invalid request method and/or path: {method} {path}")
        pattern, schema, path_id = found
        if schema is None:
            if body is not None:
                raise Fault(f"{method} {path} takes no body")
        else:
            try:
                jsonschema.validate(body, schema)
            except jsonschema.ValidationError as exc:
                raise Fault(f"schema: {exc.message}") from None
        if path_id is not None:
            field = PATH_ID_FIELDS[path.split("/")[1]]
            if body.get(field) != path_id:
                raise Fault(f"The id from the path [{path_id}] does not match the id from "
                            f"the body [{body.get(field)}]!")
        if self.fail == f"{method} {path}":
            raise Fault(f"injected fault for {method} {path}")
        started = self.state != "Not started"
        if method == "PUT" and pattern in PRE_BOOT:
            if started:
                raise Fault("The requested operation is not supported after starting the "
                            "microVM.")
            self.configured = True
        handler = self._handlers().get((method, pattern))
        return handler(body, path_id) if handler else None

    def _handlers(self) -> dict[tuple[str, str], Any]:
        return {
            ("GET", "/"): self._get_root,
            ("GET", "/balloon"): self._get_balloon,
            ("GET", "/balloon/statistics"): self._get_balloon_statistics,
            ("PUT", "/machine-config"): self._put_machine_config,
            ("PUT", "/boot-source"): self._put_boot_source,
            ("PUT", r"/drives/([^/]+)"): self._put_drives,
            ("PATCH", r"/drives/([^/]+)"): self._patch_drives,
            ("PUT", r"/network-interfaces/([^/]+)"): self._put_network_interfaces,
            ("PUT", "/balloon"): self._put_balloon,
            ("PATCH", "/balloon"): self._patch_balloon,
            ("PUT", "/actions"): self._put_actions,
            ("PATCH", "/vm"): self._patch_vm,
            ("PUT", "/snapshot/create"): self._create,
            ("PUT", "/snapshot/load"): self._load,
        }

    # -- GET ----------------------------------------------------------------------------

    def _get_root(self, body: Any, path_id: str | None) -> Any:
        return {"app_name": "Firecracker", "id": "anonymous-instance", "state": self.state,
                "vmm_version": "0.0.0-fake"}

    def _get_balloon(self, body: Any, path_id: str | None) -> Any:
        if self.balloon is None:
            raise Fault("Balloon device not configured.")
        return self.balloon

    # -- pre-boot -----------------------------------------------------------------------

    def _put_machine_config(self, body: Any, path_id: str | None) -> None:
        self.machine = {"track_dirty_pages": False, **body}

    def _put_boot_source(self, body: Any, path_id: str | None) -> None:
        if not Path(body["kernel_image_path"]).is_file():
            raise Fault(f"Cannot open kernel image: {body['kernel_image_path']}")
        self.boot = body

    def _put_drives(self, body: Any, path_id: str | None) -> None:
        assert path_id is not None
        if "path_on_host" not in body or "is_read_only" not in body:
            raise Fault("virtio-block drives need path_on_host and is_read_only")
        if not Path(body["path_on_host"]).exists():
            raise Fault(f"Unable to open block device: {body['path_on_host']}")
        if body["is_root_device"] and any(d["is_root_device"] for i, d in
                                          self.drives.items() if i != path_id):
            raise Fault("A root block device already exists!")
        self.drives[path_id] = body

    def _put_network_interfaces(self, body: Any, path_id: str | None) -> None:
        assert path_id is not None
        self.ifaces[path_id] = body

    def _put_balloon(self, body: Any, path_id: str | None) -> None:
        if body["amount_mib"] > self.machine["mem_size_mib"]:
            raise Fault("Amount of pages requested is too large.")
        self.balloon = body

    def _put_actions(self, body: Any, path_id: str | None) -> None:
        if body["action_type"] != "InstanceStart":
            return
        if self.state != "Not started":
            raise Fault("The requested operation is not supported after starting the microVM.")
        if self.boot is None:
            raise Fault("Cannot start microvm without kernel configuration.")
        self.state = "Running"
        print(f"fake guest booted: {self.boot.get('boot_args', '')}", flush=True)

    # -- post-boot ----------------------------------------------------------------------

    def _need_started(self) -> None:
        if self.state == "Not started":
            raise Fault("The requested operation is not supported before starting the "
                        "microVM.")

    def _patch_vm(self, body: Any, path_id: str | None) -> None:
        self._need_started()
        self.state = "Paused" if body["state"] == "Paused" else "Running"

    def _patch_drives(self, body: Any, path_id: str | None) -> None:
        self._need_started()
        assert path_id is not None
        if path_id not in self.drives:
            raise Fault(f"Invalid block device ID: {path_id}")
        if "path_on_host" in body:
            if not Path(body["path_on_host"]).exists():
                raise Fault(f"Unable to open block device: {body['path_on_host']}")
            self.drives[path_id] = {**self.drives[path_id],
                                    "path_on_host": body["path_on_host"]}

    def _patch_balloon(self, body: Any, path_id: str | None) -> None:
        self._need_started()
        if self.balloon is None:
            raise Fault("Balloon device not configured.")
        if body["amount_mib"] > self.machine["mem_size_mib"]:
            raise Fault("Amount of pages requested is too large.")
        self.balloon = {**self.balloon, "amount_mib": body["amount_mib"]}

    def _create(self, body: Any, path_id: str | None) -> None:
        if self.state != "Paused":
            raise Fault("Cannot create snapshot: the microVM is not paused.")
        doc = {"machine": self.machine, "drives": self.drives, "ifaces": self.ifaces,
               "balloon": self.balloon, "type": body.get("snapshot_type", "Full")}
        Path(body["snapshot_path"]).write_text(json.dumps(doc))
        Path(body["mem_file_path"]).write_bytes(b"fake guest memory\n")

    def _load(self, body: Any, path_id: str | None) -> None:
        if self.configured or self.state != "Not started":
            raise Fault("Loading a microVM snapshot not allowed after configuring boot-"
                        "specific resources.")
        mem = body["mem_backend"]["backend_path"] if "mem_backend" in body \
            else body["mem_file_path"]
        for f in (body["snapshot_path"], mem):
            if not Path(f).is_file():
                raise Fault(f"Load snapshot error: cannot open {f}")
        doc = json.loads(Path(body["snapshot_path"]).read_text())
        for drive in doc["drives"].values():
            if not Path(drive["path_on_host"]).exists():
                raise Fault(f"Unable to open block device: {drive['path_on_host']}")
        for over in body.get("network_overrides", []):
            if over["iface_id"] not in doc["ifaces"]:
                raise Fault(f"Invalid network override: unknown iface {over['iface_id']}")
            doc["ifaces"][over["iface_id"]]["host_dev_name"] = over["host_dev_name"]
        self.machine = {**doc["machine"],
                        "track_dirty_pages": body.get("track_dirty_pages", False)}
        self.drives, self.ifaces, self.balloon = doc["drives"], doc["ifaces"], doc["balloon"]
        self.configured = True
        self.state = "Running" if body.get("resume_vm") else "Paused"

    def _get_balloon_statistics(self, body: Any, path_id: str | None) -> Any:
        self._need_started()
        if self.balloon is None or not self.balloon.get("stats_polling_interval_s"):
            raise Fault("Statistics for the balloon device are not enabled")
        mib = self.balloon["amount_mib"]
        return {"target_pages": mib * 256, "actual_pages": mib * 256, "target_mib": mib,
                "actual_mib": mib, "free_memory": 1 << 20}

    def record(self, method: str, path: str, body: Any, status: int, reply: Any) -> None:
        if self.log:
            with open(self.log, "a") as f:
                f.write(json.dumps({"method": method, "path": path, "body": body,
                                    "status": status, "reply": reply,
                                    "state": self.state}) + "\n")


async def serve(fc: FakeFirecracker, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            method, target, _ = line.decode().split(" ", 2)
            headers: dict[str, str] = {}
            while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                status, reply = 400, {"fault_message": "body is not JSON"}
            else:
                if os.environ.get("FAKE_FC_CRASH") == f"{method} {target}":
                    print(f"fake firecracker: crashing on {method} {target}", file=sys.stderr,
                          flush=True)
                    os._exit(9)
                if os.environ.get("FAKE_FC_HANG") == f"{method} {target}":
                    await asyncio.Event().wait()
                status, reply = fc.handle(method, target, body)
                if status == 200 and reply is None:
                    status = 204
            if not (method == "GET" and target == "/"):  # readiness polls: not recorded
                fc.record(method, target, body, status, reply)
            data = b"" if reply is None else json.dumps(reply).encode()
            reason = {200: "OK", 204: "No Content", 400: "Bad Request"}[status]
            head = f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(data)}\r\n"
            if data:
                head += "Content-Type: application/json\r\n"
            writer.write(head.encode() + b"\r\n" + data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def main(argv: list[str]) -> int:
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    if len(argv) % 2 or set(opts) - {"--api-sock", "--log-path"} or "--api-sock" not in opts:
        print(f"usage: firecracker --api-sock PATH [--log-path PATH] (got {argv})",
              file=sys.stderr)
        return 2
    if "--log-path" in opts:  # Firecracker creates the log file and logs there, not stdout
        with open(opts["--log-path"], "a") as log:
            log.write("fake firecracker: logger configured\n")
    mode = os.environ.get("FAKE_FC_MODE", "")
    if mode == "exit":
        print("fake firecracker: told to exit", file=sys.stderr)
        return 3
    sock = Path(opts["--api-sock"])
    if sock.exists():
        print(f"Failed to open the API socket: {sock} exists", file=sys.stderr)
        return 1
    return asyncio.run(run(sock, listen=mode != "never-listen"))


async def run(sock: Path, *, listen: bool) -> int:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if not listen:
        print("fake firecracker: not opening the API socket", file=sys.stderr, flush=True)
        await stop.wait()
        return 0
    fc = FakeFirecracker()
    server = await asyncio.start_unix_server(lambda r, w: serve(fc, r, w), path=str(sock))
    print(f"fake firecracker listening on {sock} at {time.time():.3f}", file=sys.stderr,
          flush=True)
    await stop.wait()
    server.close()  # not wait_closed(): a hung request (FAKE_FC_HANG) must not delay exit
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
