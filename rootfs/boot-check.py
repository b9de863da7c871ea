#!/usr/bin/env python3
"""Boot the built image once under QEMU -M microvm and check it end to end.

    rootfs/boot-check.py [--image NAME] [--keep-console] [--timeout S]

Reads ${AENV_CACHE:-/var/cache/aenv}/images/NAME/manifest.json, boots its kernel (PVH
vmlinux) over a throwaway qcow2 overlay of rootfs.ext4 (the image itself is never written),
with user-mode networking forwarding a free host port to envd :49983, then:
  - waits for GET /health == 204 and reports the time from QEMU start,
  - runs `uname -r`, `id user`, `sudo -n true` as `user` through the e2b SDK when it is
    importable (E2B_DEBUG + E2B_SANDBOX_URL), else through a raw Connect call,
  - powers the guest off with SIGTERM to QEMU's init path (`kill -TERM 1` in the guest)
    and checks QEMU exits by itself.
Prints the QEMU argv it used. Exit status 0 = all checks passed.
Standard library only (plus the e2b SDK when available), so it runs from any Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def host_tsc_khz() -> int:
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout
        m = re.search(r"tsc: Refined TSC clocksource calibration: ([0-9.]+) MHz", out) or \
            re.search(r"tsc: Detected ([0-9.]+) MHz", out)
        if m:
            return int(float(m.group(1)) * 1000)
    except OSError:
        pass
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    raise RuntimeError("cannot find the host TSC frequency")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


def run_via_sdk(url: str, cmds: list[tuple[str, str]]) -> list[str]:
    os.environ["E2B_DEBUG"] = "true"
    os.environ["E2B_SANDBOX_URL"] = url
    os.environ.setdefault("E2B_API_KEY", "e2b_" + "0" * 40)
    from e2b import Sandbox

    sbx = Sandbox.create()
    outs = []
    for user, cmd in cmds:
        r = sbx.commands.run(cmd, user=user, timeout=60)
        outs.append(f"[{user}] $ {cmd} -> exit {r.exit_code}: {r.stdout.strip()}")
        if r.exit_code != 0 or "unable to resolve" in r.stderr:
            raise RuntimeError(outs[-1] + " " + r.stderr)
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="default")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--keep-console", action="store_true", help="print the serial console")
    a = ap.parse_args()

    cache = os.environ.get("AENV_CACHE", "/var/cache/aenv")
    with open(os.path.join(cache, "images", a.image, "manifest.json")) as f:
        man = json.load(f)
    if not man.get("kernel"):
        print("manifest has no kernel: run make kernel, then make image", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="aenv-boot-")
    disk = os.path.join(work, "disk.qcow2")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b",
                    man["rootfs"]["path"], disk], check=True)
    port = free_port()
    cmdline = man["cmdline"].format(tsc_khz=host_tsc_khz()) + " aenv.hostname=boot-check"
    console = os.path.join(work, "console.log")
    argv = [
        "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-cpu", "max",
        "-smp", "2", "-m", a.memory, "-nodefaults", "-no-user-config", "-nographic",
        "-no-reboot",
        "-kernel", man["kernel"]["vmlinux"], "-append", cmdline,
        "-serial", f"file:{console}",
        "-drive", f"id=root,file={disk},format=qcow2,if=none,cache=unsafe",
        "-device", "virtio-blk-device,drive=root",
        "-netdev", f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:49983",
        "-device", "virtio-net-device,netdev=net0",
        "-device", "virtio-rng-device",
    ]
    print("qemu:", " ".join(argv))
    t0 = time.monotonic()
    qemu = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    ok = False
    try:
        while time.monotonic() - t0 < a.timeout:
            if qemu.poll() is not None:
                raise RuntimeError(f"qemu exited with {qemu.returncode}")
            if health(url) == 204:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("no /health within the timeout")
        t_health = time.monotonic() - t0
        print(f"health: 204 after {t_health:.2f}s from QEMU start")
        cmds = [("user", "uname -r"), ("user", "id user"), ("user", "sudo -n true && echo sudo-ok"),
                ("user", "hostname | grep -x boot-check"),
                ("root", "cat /proc/cmdline; ip -4 -o addr show eth0; mount | head -3")]
        for line in run_via_sdk(url, cmds):
            print(line)
        # power off through init: SIGTERM to PID 1 (as root)
        try:
            run_via_sdk(url, [("root", "kill -TERM 1")])
        except Exception as e:  # noqa: BLE001 - the connection may drop while powering off
            print(f"(kill -TERM 1: {type(e).__name__}, expected while powering off)")
        t_off = time.monotonic()
        qemu.wait(timeout=30)
        print(f"poweroff: qemu exited with {qemu.returncode} {time.monotonic() - t_off:.2f}s "
              f"after SIGTERM to init")
        ok = qemu.returncode == 0
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
        text = ""
        if os.path.exists(console):
            with open(console, errors="replace") as f:
                text = f.read()
        if a.keep_console or not ok:
            print("---- console ----\n" + text[-6000:])
        else:
            print("\n".join(ln for ln in text.splitlines() if "aenv-init" in ln))
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
