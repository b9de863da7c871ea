"""host/proxy/tls.py: CA + wildcard leaf, private keys 0600, reuse and reissue rules,
and a server context that a client trusting the CA accepts (ALPN http/1.1)."""

from __future__ import annotations

import asyncio
import ssl
import stat

from cryptography import x509

from host.proxy.tls import ensure_certificates, server_ssl_context


def sans(path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(v) for v in ext.get_values_for_type(x509.DNSName)} | {
        str(v) for v in ext.get_values_for_type(x509.IPAddress)}


def test_certificates_are_created_reused_and_reissued(tmp_path) -> None:
    paths = ensure_certificates(tmp_path, "sbx.example.com")
    assert sans(paths.cert) == {"*.sbx.example.com", "sbx.example.com", "api.sbx.example.com",
                                "sandbox.sbx.example.com", "localhost", "127.0.0.1"}
    assert stat.S_IMODE(paths.key.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600
    first = paths.cert.read_bytes()
    assert ensure_certificates(tmp_path, "sbx.example.com").cert.read_bytes() == first
    ca_before = paths.ca_cert.read_bytes()
    other = ensure_certificates(tmp_path, "sbx.example.com", extra_names=("node1.lan",))
    assert "node1.lan" in sans(other.cert) and other.ca_cert.read_bytes() == ca_before


async def test_server_context_is_trusted_via_the_ca(tmp_path) -> None:
    paths = ensure_certificates(tmp_path, "sbx.example.com")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hi")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ssl_context(paths))
    async with server:
        port = server.sockets[0].getsockname()[1]
        client = ssl.create_default_context(cafile=str(paths.ca_cert))
        client.set_alpn_protocols(["h2", "http/1.1"])
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client, server_hostname="49983-abc.sbx.example.com")
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "http/1.1"
        assert await reader.read() == b"hi"
        writer.close()
