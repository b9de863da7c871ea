"""Optional TLS for E2B_DOMAIN mode: a local CA and a wildcard certificate for *.<domain>.

The SDK always talks HTTPS to `https://49983-<id>.<domain>` and `https://api.<domain>`
unless E2B_DEBUG / an http:// E2B_SANDBOX_URL is used, so a self-hosted service needs a
certificate for `*.<domain>` that clients trust: install `ca.pem` into the OS store, or
point SSL_CERT_FILE / NODE_EXTRA_CA_CERTS at it.

ALPN: uvicorn speaks HTTP/1.1 only, so we offer just `http/1.1`; both SDKs offer `h2` and
`http/1.1` and fall back (checked with the Py SDK in tests/proxy/test_tls.py).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from host.private import private_dir, write_private

_RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class CertPaths:
    ca_cert: Path
    cert: Path      # leaf certificate followed by the CA (full chain)
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if (isinstance(key, ec.EllipticCurvePrivateKey)
                and cert.not_valid_after_utc - _RENEW_BEFORE > dt.datetime.now(dt.UTC)):
            return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv local CA")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _names(domain: str, extra: tuple[str, ...]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in (f"*.{domain}", domain, f"api.{domain}", f"sandbox.{domain}", *extra):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def ensure_certificates(directory: Path | str, domain: str,
                        extra_names: tuple[str, ...] = ("localhost", "127.0.0.1")) -> CertPaths:
    """Create (or reuse) the CA and a leaf for *.<domain>, api./sandbox.<domain> + extras.

    A leaf is reissued when its names differ or it expires within 30 days.
    """
    directory = private_dir(directory)
    ca_cert, ca_key = _load_ca(directory)
    paths = CertPaths(directory / "ca.pem", directory / f"{domain}.pem",
                      directory / f"{domain}-key.pem")
    wanted = _names(domain, extra_names)
    if paths.cert.exists() and paths.key.exists():
        leaf = x509.load_pem_x509_certificate(paths.cert.read_bytes())
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        fresh = leaf.not_valid_after_utc - _RENEW_BEFORE > dt.datetime.now(dt.UTC)
        if fresh and set(san) == set(wanted) and leaf.issuer == ca_cert.subject:
            return paths
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"*.{domain}")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=397))
            .add_extension(x509.SubjectAlternativeName(wanted), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_private(paths.key, _key_pem(key))
    paths.cert.write_bytes(leaf.public_bytes(serialization.Encoding.PEM)
                           + ca_cert.public_bytes(serialization.Encoding.PEM))
    return paths


def server_ssl_context(paths: CertPaths) -> ssl.SSLContext:
    """A server context for these certificates, ALPN `http/1.1` (see module docstring)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(paths.cert, paths.key)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
