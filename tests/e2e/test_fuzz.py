"""Fuzzing the real service with real VMs (issue 14): no input may produce a 5xx.

- schemathesis against the running host service's own /openapi.json (real runtime:
  creates it generates boot real sandboxes from the template);
- malformed Connect envelopes and `/files` bodies against a real guest's envd, through
  the proxy: random bytes, cut headers, lengths that lie, bodies that do not decode,
  broken multipart; afterwards the guest still works.

Counts (requests sent, 5xx seen) are printed for the record; seeds are fixed so a failure
reproduces."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from .conftest import E2EService, use_sdk

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ENVD = 49983
RPCS = ("/process.Process/Start", "/process.Process/List", "/process.Process/Connect",
        "/process.Process/SendInput", "/process.Process/SendSignal",
        "/process.Process/Update", "/process.Process/StreamInput",
        "/filesystem.Filesystem/Stat", "/filesystem.Filesystem/ListDir",
        "/filesystem.Filesystem/MakeDir", "/filesystem.Filesystem/Move",
        "/filesystem.Filesystem/Remove", "/filesystem.Filesystem/WatchDir",
        "/filesystem.Filesystem/CreateWatcher", "/filesystem.Filesystem/GetWatcherEvents",
        "/filesystem.Filesystem/RemoveWatcher")
CONTENT_TYPES = ("application/connect+proto", "application/connect+json", "application/proto",
                 "application/json", "application/grpc", "text/plain", "")


def _envelope(rng: random.Random) -> bytes:
    kind = rng.randrange(7)
    payload = rng.randbytes(rng.randrange(0, 64))
    if kind == 0:      # random bytes
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 1:      # a header cut short
        return bytes([rng.randrange(256)]) + rng.randbytes(rng.randrange(0, 4))
    if kind == 2:      # a length that promises more than is sent
        return b"\x00" + (len(payload) + rng.randrange(1, 1 << 20)).to_bytes(4, "big") + payload
    if kind == 3:      # a huge declared length
        return b"\x00\xff\xff\xff\xff" + payload
    if kind == 4:      # a well-framed payload that does not decode
        return b"\x00" + len(payload).to_bytes(4, "big") + payload
    if kind == 5:      # compressed flag without compression negotiated, or unknown flags
        return bytes([rng.choice((1, 3, 0x80, 0xff))]) + len(payload).to_bytes(4, "big") + payload
    # JSON of the wrong shape, framed properly
    body = json.dumps(rng.choice([[], {"process": 7}, {"path": {"x": 1}}, "str", None,
                                  {"process": {"cmd": ""}}, {"pid": -1}])).encode()
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _files_body(rng: random.Random) -> tuple[dict[str, str], bytes]:
    boundary = "b" + str(rng.randrange(10**9))
    kind = rng.randrange(6)
    if kind == 0:
        return {"content-type": f"multipart/form-data; boundary={boundary}"}, rng.randbytes(200)
    if kind == 1:      # no closing boundary
        return ({"content-type": f"multipart/form-data; boundary={boundary}"},
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"x\"\r\n\r\nabc".encode())
    if kind == 2:      # no boundary parameter
        return {"content-type": "multipart/form-data"}, rng.randbytes(50)
    if kind == 3:      # a part without a name or filename
        return ({"content-type": f"multipart/form-data; boundary={boundary}"},
                f"--{boundary}\r\n\r\nxyz\r\n--{boundary}--\r\n".encode())
    if kind == 4:      # octet-stream with garbage, maybe gzip-declared
        h = {"content-type": "application/octet-stream"}
        if rng.random() < 0.5:
            h["content-encoding"] = "gzip"
        return h, rng.randbytes(rng.randrange(0, 300))
    return {"content-type": rng.choice(["text/plain", "application/json", ""])}, rng.randbytes(30)


def test_schemathesis_against_the_real_service(service: E2EService, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis CLI not installed")
    proc = subprocess.run(
        [st, "run", f"{service.api_url}/openapi.json", "-H", f"X-API-Key: {service.api_key}",
         "--max-examples", "8", "--seed", "11", "--checks", "not_a_server_error",
         "--no-color", "--workers", "1", "--request-timeout", "300"],
        capture_output=True, text=True, timeout=2400, cwd=tmp_path, check=False)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    with service.client() as c:   # what the fuzzer created must not outlive the test
        for sb in c.get("/v2/sandboxes", params={"state": "running,paused"}).json():
            c.delete(f"/sandboxes/{sb['sandboxID']}")
    sent = re.search(r"(\d+)\s+(?:generated|test cases|requests?)", proc.stdout)
    print(f"\nschemathesis against the real service: exit {proc.returncode}, "
          f"{sent.group(0) if sent else '?'}\n{proc.stdout[-1500:]}")
    assert proc.returncode == 0, report
    assert "Server error" not in proc.stdout, report


def test_envd_malformed_connect_and_files_bodies(service: E2EService) -> None:
    rng = random.Random(20261203)
    with service.client() as c:
        r = c.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
        assert r.status_code == 201, r.text
        sb = r.json()
    sid, token = sb["sandboxID"], sb.get("envdAccessToken")
    base = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD)}
    if token:
        base["X-Access-Token"] = token
    statuses: Counter[int] = Counter()
    bad: list[tuple[str, int, str]] = []
    try:
        with httpx.Client(base_url=service.sandbox_url, timeout=60) as http:
            for i in range(400):
                path = rng.choice(RPCS)
                headers = dict(base, **{"connect-protocol-version": "1"})
                ctype = rng.choice(CONTENT_TYPES)
                if ctype:
                    headers["content-type"] = ctype
                body = b"".join(_envelope(rng) for _ in range(rng.randrange(1, 3)))
                r = http.post(path, content=body, headers=headers)
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    bad.append((f"{path} [{ctype}]", r.status_code, r.text[:200]))
            for i in range(200):
                headers, body = _files_body(rng)
                params = {"path": rng.choice(["/home/user/f", "/", "", "/proc/self/mem",
                                              "/home/user/" + "x" * 300, "relative/f"]),
                          "username": rng.choice(["user", "root", "nobody-here", ""])}
                method = rng.choice(["POST", "POST", "GET"])
                r = http.request(method, "/files", params=params, content=body,
                                 headers={**base, **{k: v for k, v in headers.items() if v}})
                statuses[r.status_code] += 1
                if r.status_code >= 500:
                    bad.append((f"{method} /files {params}", r.status_code, r.text[:200]))
            # the guest survived all of it
            ok = http.get("/health", headers=base)
            assert ok.status_code in (200, 204), ok.text
        from e2b import Sandbox
        with pytest.MonkeyPatch.context() as mp:
            use_sdk(service, mp)
            assert Sandbox.connect(sid).commands.run("echo alive").stdout == "alive\n"
    finally:
        with service.client() as c:
            c.delete(f"/sandboxes/{sid}")
    print(f"\nenvd fuzz through the proxy: {sum(statuses.values())} requests, statuses "
          f"{dict(sorted(statuses.items()))}, 5xx: {len(bad)}")
    assert bad == [], sorted({(b[1], b[2][:120], b[0].split(" [")[-1]) for b in bad})
