"""Test helper process: maps a base file MAP_PRIVATE (like a share=off QEMU) and obeys stdin.

    addr                  -> "<start address> <length>"
    write SEED P1,P2,...  -> writes page_pattern(SEED, P) into each page P; "ok"
    read P1,P2,...        -> touches (reads) the pages; "ok"
    page P                -> hex of the page content
    sha                   -> sha256 hex of the whole mapping
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import sys

PAGE = mmap.PAGESIZE


def page_pattern(seed: str, page: int) -> bytes:
    block = hashlib.sha256(f"{seed}:{page}".encode()).digest()
    return block * (PAGE // len(block))


def main() -> None:
    path = sys.argv[1]
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "addr":
            out = f"{addr} {size}"
        elif cmd == "write":
            for p in (int(x) for x in args[1].split(",") if x):
                m[p * PAGE : (p + 1) * PAGE] = page_pattern(args[0], p)
            out = "ok"
        elif cmd == "read":
            total = 0
            for p in (int(x) for x in args[0].split(",") if x):
                total += m[p * PAGE]
            out = "ok"
        elif cmd == "page":
            p = int(args[0])
            out = m[p * PAGE : (p + 1) * PAGE].hex()
        elif cmd == "sha":
            out = hashlib.sha256(m).hexdigest()
        else:
            out = f"error unknown {cmd}"
        print(out, flush=True)


if __name__ == "__main__":
    main()
