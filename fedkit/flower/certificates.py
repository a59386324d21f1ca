"""TLS certificates for a deployment: a CA of the operator's own and a SuperLink
certificate it signs (``fedkit deploy certs``).

Flower's SuperLink serves TLS with ``--ssl-ca-certfile``, ``--ssl-certfile`` and
``--ssl-keyfile``; every node and submitter verifies it with the CA certificate
(``--root-certificates``). The server certificate must name the addresses the nodes dial
(IP addresses or DNS names, in its subject alternative names). Made with the
``cryptography`` package Flower already needs, so a site needs no ``openssl``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

FILES = ("ca.crt", "ca.key", "server.pem", "server.key")
"""What ``make_certificates`` writes: the CA's certificate (hand it to every node and
submitter) and key (keep it to sign a new server certificate), and the SuperLink's."""


def subject_names(names: list[str]) -> list[x509.GeneralName]:
    """Each name as an IP address when it reads as one, else as a DNS name; ``ValueError``
    naming one that is neither."""
    found: list[x509.GeneralName] = []
    for name in names:
        try:
            found.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            label = name.rstrip(".")
            if not label or any(c.isspace() or c in "/:@" for c in label):
                raise ValueError(f"{name!r} is neither an IP address nor a DNS name") from None
            found.append(x509.DNSName(label))
    if not found:
        raise ValueError("name at least one address the nodes dial (an IP address or DNS name)")
    return found


def make_certificates(folder: Path, names: list[str], days: int = 365) -> dict[str, Path]:
    """Write a new CA and a SuperLink certificate it signs for ``names`` into ``folder``
    (made if missing; the keys readable by their owner only). An existing file is never
    replaced: certificates the nodes already trust would stop matching."""
    alternative = subject_names(names)
    if days < 1:
        raise ValueError(f"days: expected at least 1, got {days}")
    paths = {name: folder / name for name in FILES}
    for path in paths.values():
        if path.exists():
            raise FileExistsError(f"{path} exists; certificates are not replaced")
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = (
        ec.generate_private_key(ec.SECP384R1()),
        ec.generate_private_key(ec.SECP384R1()),
    )
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedkit deployment CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    for key, path in ((ca_key, paths["ca.key"]), (server_key, paths["server.key"])):
        secret = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(secret)
    paths["ca.crt"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["server.pem"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    return paths
