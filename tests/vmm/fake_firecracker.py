"""A stand-in `firecracker` executable for the driver tests (no real Firecracker here:
the development host has no binary and only a PVM KVM).

Run as `fake_firecracker.py --api-sock PATH [--log-path PATH] [--id=ID ...]` (or
`--version`): serves HTTP/1.1 on the unix socket, checks every request against
Firecracker's published OpenAPI document (`firecracker_openapi.py`, v1.16.1: method,
path, body schema, path id = body id), simulates the state rules Firecracker documents
and answers 204/200 or 400 {"fault_message": ...} like the real one:

- pre-boot resources (machine-config, boot-source, drives, network-interfaces, balloon)
  only before InstanceStart; kernel and drive files must exist; one root drive;
- InstanceStart only once and only after boot-source;
- PATCH /vm only after start; PUT /snapshot/create only while Paused;
- PUT /snapshot/load only on a fresh process (nothing configured), exactly one of
  mem_backend / mem_file_path; the state and memory files and the saved drive paths must
  exist (drive paths are reopened as saved: relative ones against the new process's
  working directory).

Guest memory is simulated page by page (4 KiB): InstanceStart writes pages 0-3; a Full
snapshot writes the whole memory, a Diff snapshot (sparse) only the pages dirtied since
the last snapshot or load (all non-zero pages without track_dirty_pages, like
Firecracker's mincore mode); a load reads the memory file.

Environment knobs (inherited through the driver's spawn):
  FAKE_FC_LOG      append one JSON line per request: method, path, body, status
  FAKE_FC_MODE     "never-listen": run without opening the socket; "exit": exit 3 at once
  FAKE_FC_FAIL     "METHOD PATH": answer that request with 400 and an injected fault
  FAKE_FC_CRASH    "METHOD PATH": exit with code 9 on receiving that request
  FAKE_FC_HANG     "METHOD PATH": never answer that request
  FAKE_FC_GUEST    JSON file {"page": byte}: what the guest wrote while running, applied
                   (and the file removed) when the VM is next paused
  FAKE_FC_ROOT     set by fake_jailer.py: the chroot (absolute paths resolve inside it,
                   paths that lead outside it fail)
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

from tests.vmm.firecracker_openapi import OpenApi, RequestRejected

PAGE = 4096
PRE_BOOT = {"/machine-config", "/boot-source", "/drives/{drive_id}",
            "/network-interfaces/{iface_id}", "/balloon"}


class Fault(Exception):
    pass


def host_path(p: str) -> Path:
    """What the process opens for `p`: relative to its cwd; inside the jail if jailed."""
    root = os.environ.get("FAKE_FC_ROOT")
    if not root:
        return Path(p)
    q = Path(root) / p.lstrip("/")
    real, jail = os.path.realpath(q), os.path.realpath(root)
    if real != jail and not real.startswith(jail + "/"):
        raise Fault(f"{p}: No such file or directory (outside the jail)")
    return q


class Memory:
    """Guest RAM: page index -> content (absent pages are zero)."""

    def __init__(self, mib: int) -> None:
        self.size = mib << 20
        self.pages: dict[int, bytes] = {}
        self.dirty: set[int] = set()

    def write(self, page: int, content: bytes) -> None:
        self.pages[page] = content
        self.dirty.add(page)

    def dump(self, path: Path, *, full: bool, tracking: bool) -> None:
        with open(path, "wb") as f:
            f.truncate(self.size)
            if full:
                zero = bytes(1 << 20)
                f.writelines(zero for _ in range(0, self.size, len(zero)))
                pages = set(self.pages)
            else:
                pages = self.dirty if tracking else set(self.pages)
            for p in sorted(pages):
                f.seek(p * PAGE)
                f.write(self.pages.get(p, bytes(PAGE)))
        self.dirty = set()

    def load(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.size:
                raise Fault(f"Load snapshot error: memory file has {size} bytes, the "
                            f"snapshot {self.size}")
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError:
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                for p in range(start // PAGE, -(-end // PAGE)):
                    data = os.pread(fd, PAGE, p * PAGE)
                    if data.count(0) != len(data):
                        self.pages[p] = data
                pos = end
        finally:
            os.close(fd)
        self.dirty = set()


class FakeFirecracker:
    def __init__(self) -> None:
        self.api = OpenApi.load()
        self.state = "Not started"
        self.machine: dict[str, Any] = {"vcpu_count": 1, "mem_size_mib": 128,
                                        "track_dirty_pages": False}
        self.boot: dict[str, Any] | None = None
        self.drives: dict[str, dict[str, Any]] = {}
        self.ifaces: dict[str, dict[str, Any]] = {}
        self.balloon: dict[str, Any] | None = None
        self.memory: Memory | None = None
        self.configured = False
        self.log = os.environ.get("FAKE_FC_LOG")
        self.fail = os.environ.get("FAKE_FC_FAIL")

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        try:
            return 200, self._handle(method, path, body)
        except (Fault, RequestRejected) as exc:
            return 400, {"fault_message": str(exc)}

    def _handle(self, method: str, path: str, body: Any) -> Any:
        endpoint, params = self.api.check(method, path, body)
        if self.fail == f"{method} {path}":
            raise Fault(f"injected fault for {method} {path}")
        started = self.state != "Not started"
        if method == "PUT" and endpoint.template in PRE_BOOT:
            if started:
                raise Fault("The requested operation is not supported after starting the "
                            "microVM.")
            self.configured = True
        handler = self._handlers().get((method, endpoint.template))
        return handler(body, params) if handler else None

    def _handlers(self) -> dict[tuple[str, str], Any]:
        return {
            ("GET", "/"): self._get_root,
            ("GET", "/version"): lambda b, p: {"firecracker_version": self.api.version},
            ("GET", "/balloon"): self._get_balloon,
            ("GET", "/balloon/statistics"): self._get_balloon_statistics,
            ("PUT", "/machine-config"): self._put_machine_config,
            ("PUT", "/boot-source"): self._put_boot_source,
            ("PUT", "/drives/{drive_id}"): self._put_drives,
            ("PATCH", "/drives/{drive_id}"): self._patch_drives,
            ("PUT", "/network-interfaces/{iface_id}"): self._put_network_interfaces,
            ("PUT", "/balloon"): self._put_balloon,
            ("PATCH", "/balloon"): self._patch_balloon,
            ("PUT", "/actions"): self._put_actions,
            ("PATCH", "/vm"): self._patch_vm,
            ("PUT", "/snapshot/create"): self._create,
            ("PUT", "/snapshot/load"): self._load,
        }

    # -- GET ----------------------------------------------------------------------------

    def _get_root(self, body: Any, params: dict[str, str]) -> Any:
        return {"app_name": "Firecracker", "id": "anonymous-instance", "state": self.state,
                "vmm_version": f"{self.api.version}-fake"}

    def _get_balloon(self, body: Any, params: dict[str, str]) -> Any:
        if self.balloon is None:
            raise Fault("Balloon device not configured.")
        return self.balloon

    # -- pre-boot -----------------------------------------------------------------------

    def _put_machine_config(self, body: Any, params: dict[str, str]) -> None:
        self.machine = {"track_dirty_pages": False, **body}

    def _put_boot_source(self, body: Any, params: dict[str, str]) -> None:
        if not host_path(body["kernel_image_path"]).is_file():
            raise Fault(f"Cannot open kernel image: {body['kernel_image_path']}")
        if "initrd_path" in body and not host_path(body["initrd_path"]).is_file():
            raise Fault(f"Cannot open initrd: {body['initrd_path']}")
        self.boot = body

    def _put_drives(self, body: Any, params: dict[str, str]) -> None:
        drive_id = params["drive_id"]
        if "path_on_host" not in body or "is_read_only" not in body:
            raise Fault("virtio-block drives need path_on_host and is_read_only")
        if not host_path(body["path_on_host"]).exists():
            raise Fault(f"Unable to open block device: {body['path_on_host']}")
        if body["is_root_device"] and any(d["is_root_device"] for i, d in
                                          self.drives.items() if i != drive_id):
            raise Fault("A root block device already exists!")
        self.drives[drive_id] = body

    def _put_network_interfaces(self, body: Any, params: dict[str, str]) -> None:
        self.ifaces[params["iface_id"]] = body

    def _put_balloon(self, body: Any, params: dict[str, str]) -> None:
        if body["amount_mib"] > self.machine["mem_size_mib"]:
            raise Fault("Amount of pages requested is too large.")
        self.balloon = body

    def _put_actions(self, body: Any, params: dict[str, str]) -> None:
        if body["action_type"] != "InstanceStart":
            return
        if self.state != "Not started":
            raise Fault("The requested operation is not supported after starting the microVM.")
        if self.boot is None:
            raise Fault("Cannot start microvm without kernel configuration.")
        self.memory = Memory(self.machine["mem_size_mib"])
        for p in range(4):  # the kernel and its early data
            self.memory.write(p, (b"boot%d" % p).ljust(PAGE, b"."))
        self.state = "Running"
        print(f"fake guest booted: {self.boot.get('boot_args', '')}", flush=True)

    # -- post-boot ----------------------------------------------------------------------

    def _need_started(self) -> None:
        if self.state == "Not started":
            raise Fault("The requested operation is not supported before starting the "
                        "microVM.")

    def _patch_vm(self, body: Any, params: dict[str, str]) -> None:
        self._need_started()
        if body["state"] == "Paused" and self.state == "Running":
            self._guest_ran()
        self.state = "Paused" if body["state"] == "Paused" else "Running"

    def _guest_ran(self) -> None:
        writes = os.environ.get("FAKE_FC_GUEST")
        if not writes or not Path(writes).exists() or self.memory is None:
            return
        for page, byte in json.loads(Path(writes).read_text()).items():
            self.memory.write(int(page), bytes([byte]) * PAGE)
        Path(writes).unlink()

    def _patch_drives(self, body: Any, params: dict[str, str]) -> None:
        self._need_started()
        drive_id = params["drive_id"]
        if drive_id not in self.drives:
            raise Fault(f"Invalid block device ID: {drive_id}")
        if "path_on_host" in body:
            if not host_path(body["path_on_host"]).exists():
                raise Fault(f"Unable to open block device: {body['path_on_host']}")
            self.drives[drive_id] = {**self.drives[drive_id],
                                     "path_on_host": body["path_on_host"]}

    def _patch_balloon(self, body: Any, params: dict[str, str]) -> None:
        self._need_started()
        if self.balloon is None:
            raise Fault("Balloon device not configured.")
        if body["amount_mib"] > self.machine["mem_size_mib"]:
            raise Fault("Amount of pages requested is too large.")
        self.balloon = {**self.balloon, "amount_mib": body["amount_mib"]}

    def _create(self, body: Any, params: dict[str, str]) -> None:
        if self.state != "Paused":
            raise Fault("Cannot create snapshot: the microVM is not paused.")
        assert self.memory is not None
        kind = body.get("snapshot_type", "Full")
        doc = {"machine": self.machine, "drives": self.drives, "ifaces": self.ifaces,
               "balloon": self.balloon, "type": kind}
        host_path(body["snapshot_path"]).write_text(json.dumps(doc))
        self.memory.dump(host_path(body["mem_file_path"]), full=kind == "Full",
                         tracking=self.machine.get("track_dirty_pages", False))

    def _load(self, body: Any, params: dict[str, str]) -> None:
        if self.configured or self.state != "Not started":
            raise Fault("Loading a microVM snapshot not allowed after configuring boot-"
                        "specific resources.")
        if ("mem_backend" in body) == ("mem_file_path" in body):
            raise Fault("Exactly one of mem_backend and mem_file_path must be given.")
        if "mem_backend" in body and body["mem_backend"]["backend_type"] != "File":
            raise Fault("the fake serves only the File memory backend")
        mem = body["mem_backend"]["backend_path"] if "mem_backend" in body \
            else body["mem_file_path"]
        for f in (body["snapshot_path"], mem):
            if not host_path(f).is_file():
                raise Fault(f"Load snapshot error: cannot open {f}")
        doc = json.loads(host_path(body["snapshot_path"]).read_text())
        for drive in doc["drives"].values():
            if not host_path(drive["path_on_host"]).exists():
                raise Fault(f"Unable to open block device: {drive['path_on_host']}")
        for over in body.get("network_overrides", []):
            if over["iface_id"] not in doc["ifaces"]:
                raise Fault(f"Invalid network override: unknown iface {over['iface_id']}")
            doc["ifaces"][over["iface_id"]]["host_dev_name"] = over["host_dev_name"]
        self.memory = Memory(doc["machine"]["mem_size_mib"])
        self.memory.load(host_path(mem))
        tracking = body.get("track_dirty_pages", body.get("enable_diff_snapshots", False))
        self.machine = {**doc["machine"], "track_dirty_pages": tracking}
        self.drives, self.ifaces, self.balloon = doc["drives"], doc["ifaces"], doc["balloon"]
        self.configured = True
        self.state = "Running" if body.get("resume_vm") else "Paused"

    def _get_balloon_statistics(self, body: Any, params: dict[str, str]) -> Any:
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


_OPTIONS = {"--api-sock", "--log-path", "--id", "--start-time-us", "--start-time-cpu-us",
            "--parent-cpu-time-us"}


def parse_args(argv: list[str]) -> dict[str, str] | None:
    """`--key value` and `--key=value` forms of the options above; None if malformed."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv):
        key, eq, val = argv[i].partition("=")
        if key not in _OPTIONS:
            return None
        if not eq:
            if i + 1 >= len(argv):
                return None
            i += 1
            val = argv[i]
        opts[key] = val
        i += 1
    return opts if "--api-sock" in opts else None


def main(argv: list[str]) -> int:
    if argv == ["--version"]:
        print(f"Firecracker v{OpenApi.load().version}\n\nfake for tests")
        return 0
    opts = parse_args(argv)
    if opts is None:
        print(f"usage: firecracker --api-sock PATH [--log-path PATH] (got {argv})",
              file=sys.stderr)
        return 2
    if "--log-path" in opts:  # Firecracker logs there, not to stdout
        with open(host_path(opts["--log-path"]), "a") as log:
            log.write("fake firecracker: logger configured\n")
    mode = os.environ.get("FAKE_FC_MODE", "")
    if mode == "exit":
        print("fake firecracker: told to exit", file=sys.stderr)
        return 3
    sock = host_path(opts["--api-sock"])
    if os.environ.get("FAKE_FC_ROOT"):  # bind as the jailed process would: short path
        os.chdir(os.environ["FAKE_FC_ROOT"])
        sock = Path(os.path.relpath(sock))
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
