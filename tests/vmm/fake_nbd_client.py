"""A stand-in `nbd-client` (Debian's nbd-client) for the block device tests: this host
has no nbd kernel module.

`fake_nbd_client.py -unix SOCKET -N EXPORT [-b N] [-readonly] /dev/nbdX` "connects" by
writing what the kernel's nbd driver shows in sysfs (`$FAKE_NBD_SYS/block/nbdX/pid` and
a non-zero `size`); `-d /dev/nbdX` disconnects (removes pid, size 0). Every argv is
appended to $FAKE_NBD_LOG (JSON lines). A device named in $FAKE_NBD_BUSY (comma
separated) fails like one another process took first. The socket must exist.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if log := os.environ.get("FAKE_NBD_LOG"):
        with open(log, "a") as f:
            f.write(json.dumps(argv) + "\n")
    sysfs = Path(os.environ["FAKE_NBD_SYS"]) / "block"
    if argv[:1] == ["-d"] and len(argv) == 2:
        d = sysfs / Path(argv[1]).name
        (d / "pid").unlink(missing_ok=True)
        (d / "size").write_text("0\n")
        return 0
    opts, rest = {}, []
    i = 0
    while i < len(argv):
        if argv[i] in ("-unix", "-N", "-b", "-name", "-block-size"):
            opts[argv[i]] = argv[i + 1]
            i += 2
        elif argv[i] == "-readonly":
            opts["-readonly"] = ""
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    if "-unix" not in opts or "-N" not in opts or len(rest) != 1:
        print(f"nbd-client: bad arguments {argv}", file=sys.stderr)
        return 1
    if not Path(opts["-unix"]).exists():
        print(f"Socket failed: {opts['-unix']}: No such file or directory", file=sys.stderr)
        return 1
    name = Path(rest[0]).name
    if name in os.environ.get("FAKE_NBD_BUSY", "").split(","):
        print(f"Error: Device or resource busy ({rest[0]})", file=sys.stderr)
        return 1
    d = sysfs / name
    (d / "pid").write_text(f"{os.getpid()}\n")
    (d / "size").write_text("2048\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
