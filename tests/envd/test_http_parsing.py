"""Pure parsing helpers of envd's /files: Accept-Encoding choice and the multipart parser."""

from __future__ import annotations

import httpx
import pytest

from envd.http.download import choose_encoding
from envd.http.multipart import (
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    parse_header_params,
)


@pytest.mark.parametrize("header, expected", [
    (None, "identity"),
    ("", "identity"),
    ("gzip", "gzip"),                          # the SDKs' gzip=True
    ("x-gzip", "gzip"),
    ("gzip;q=1.0, identity;q=0.5", "gzip"),
    ("gzip, deflate", "identity"),             # generic transport default
    ("gzip, deflate, br, zstd", "identity"),
    ("identity", "identity"),
    ("br", "identity"),                        # identity stays acceptable implicitly
    ("br, identity;q=0", None),                # 406
    ("*;q=0", None),
    ("gzip, identity;q=0", "gzip"),
    ("*", "identity"),
    ("gzip;q=0", "identity"),
])
def test_choose_encoding(header, expected):
    assert choose_encoding(header) == expected


def test_disposition_params():
    kind, params = parse_header_params(
        r'form-data; name="file"; filename="/home/user/a \"q\".txt"')
    assert kind == "form-data" and params["filename"] == '/home/user/a "q".txt'
    _, params = parse_header_params(
        "form-data; name=file; filename=plain.txt; filename*=UTF-8''%2Fhome%2Fuser%2F%C3%A9.txt")
    assert params == {"name": "file", "filename": "/home/user/é.txt"}


def _parse(body: bytes, boundary: str, step: int) -> list[object]:
    parser = MultipartParser(boundary)
    events: list[object] = []
    for i in range(0, len(body), step):
        events += parser.feed(body[i:i + step])
    parser.close()
    merged: list[object] = []
    for e in events:  # data may arrive split; compare joined
        if isinstance(e, PartData) and merged and isinstance(merged[-1], PartData):
            merged[-1] = PartData(merged[-1].data + e.data)
        else:
            merged.append(e)
    return merged


@pytest.mark.parametrize("step", [1, 2, 7, 64, 100_000])
def test_multipart_keeps_full_paths_and_binary_data(step):
    payload = b"line\r\n--not-the-boundary\r\n\x00\xff" * 50
    req = httpx.Request("POST", "http://x/", files=[
        ("file", ("/home/user/dir/a.bin", payload)),
        ("other", ("o.txt", b"zz")),
        ("file", ("relative/b.txt", b"")),
    ])
    body = req.read()
    _, params = parse_header_params(req.headers["content-type"])
    events = _parse(body, params["boundary"], step)
    starts = [e for e in events if isinstance(e, PartStart)]
    assert [(s.name, s.filename) for s in starts] == [
        ("file", "/home/user/dir/a.bin"), ("other", "o.txt"), ("file", "relative/b.txt")]
    assert events[1] == PartData(payload) and isinstance(events[2], PartEnd)
    assert isinstance(events[-1], PartEnd) and isinstance(events[-2], PartStart)


@pytest.mark.parametrize("body", [
    b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc",      # no closing
    b"--b\r\nno-colon-header\r\n\r\nabc\r\n--b--\r\n",                        # bad header
    b"--bX\r\n",                                                              # bad boundary
    b"--b\r\nContent-Disposition: attachment; name=\"file\"\r\n\r\nx\r\n--b--",
])
def test_multipart_malformed(body):
    parser = MultipartParser("b")
    with pytest.raises(MultipartError):
        parser.feed(body)
        parser.close()


def test_multipart_header_limit():
    parser = MultipartParser("b")
    with pytest.raises(MultipartError):
        parser.feed(b"--b\r\nX-Big: " + b"a" * 20_000)


@pytest.mark.parametrize("filename", [
    "/home/user/a;b c/é.txt",      # `;` and spaces inside the quotes, raw UTF-8
    "C:\\dir\\x.txt",              # Windows-looking paths are not reduced to a basename
    "\\\\server\\share\\y.txt",
    "relative/dir/z.txt",
])
def test_multipart_filenames_stay_verbatim(filename):
    quoted = filename.replace("\\", "\\\\")
    body = (f'--b\r\nContent-Disposition: form-data; name="file"; filename="{quoted}"\r\n'
            "\r\nx\r\n--b--\r\n").encode()
    start, *_ = _parse(body, "b", 5)
    assert isinstance(start, PartStart) and start.filename == filename


def test_multipart_streams_part_data():
    """Part bytes come out of the feed that brought them (minus a boundary-sized tail)."""
    parser = MultipartParser("bnd")
    head = b'--bnd\r\nContent-Disposition: form-data; name="file"; filename="/a"\r\n\r\n'
    assert [type(e) for e in parser.feed(head)] == [PartStart]
    chunk = b"\xab" * 65536
    for _ in range(4):
        emitted = sum(len(e.data) for e in parser.feed(chunk) if isinstance(e, PartData))
        assert emitted >= len(chunk) - len(b"\r\n--bnd")
    tail = parser.feed(b"\r\n--bnd--\r\n")
    assert isinstance(tail[-1], PartEnd) and parser.done
    parser.close()
