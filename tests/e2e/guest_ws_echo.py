"""Stdlib-only WebSocket echo server run INSIDE the guest (python3 there has no
`websockets`): RFC 6455 handshake, then echoes text/binary frames; answers close."""
import base64
import hashlib
import socket
import struct
import sys
import threading

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def recv_exact(c, n):
    buf = b""
    while len(buf) < n:
        d = c.recv(n - len(buf))
        if not d:
            raise EOFError
        buf += d
    return buf


def serve(c):
    try:
        head = b""
        while b"\r\n\r\n" not in head:
            d = c.recv(4096)
            if not d:
                return
            head += d
        key = b""
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"sec-websocket-key:"):
                key = line.split(b":", 1)[1].strip()
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
        c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                  b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        while True:
            b0, b1 = recv_exact(c, 2)
            op, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", recv_exact(c, 2))[0]
            elif n == 127:
                n = struct.unpack(">Q", recv_exact(c, 8))[0]
            mask = recv_exact(c, 4) if b1 & 0x80 else b"\0\0\0\0"
            data = bytes(x ^ mask[i % 4] for i, x in enumerate(recv_exact(c, n)))
            if op == 8:
                c.sendall(b"\x88" + bytes([len(data)]) + data)
                return
            if op == 9:
                op = 10
            if len(data) < 126:
                hdr = bytes([0x80 | op, len(data)])
            elif len(data) < 65536:
                hdr = bytes([0x80 | op, 126]) + struct.pack(">H", len(data))
            else:
                hdr = bytes([0x80 | op, 127]) + struct.pack(">Q", len(data))
            c.sendall(hdr + data)
    except (EOFError, OSError):
        pass
    finally:
        c.close()


s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(16)
while True:
    conn, _ = s.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
