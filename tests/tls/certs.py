"""Throwaway certificates for the TLS tests, made in a few milliseconds (P-256 keys) into a folder.

`cryptography` comes with the test dependencies (moto requires it); nothing is committed, so nothing
expires in the repository."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"))


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA every certificate below is signed by
    server_cert: Path  # for 127.0.0.1 and localhost
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of them
    other_client_cert: Path  # signed by other_ca
    other_client_key: Path
    named_cert: Path  # signed by `ca` for the DNS name "gateway.internal" only
    named_key: Path


def make_certs(folder: Path, expires_in: datetime.timedelta = datetime.timedelta(days=30)) -> Certs:
    """expires_in: from now to the leaf certificates' notAfter (negative: already expired)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca("qserve test CA")
    other_key, other = _ca("another CA")
    paths = {"ca": _write(folder / "ca.pem", _pem(ca)), "other_ca": _write(folder / "other-ca.pem", _pem(other))}
    leaves = {"server": (ca_key, ca, LOOPBACK_NAMES, ExtendedKeyUsageOID.SERVER_AUTH),
              "client": (ca_key, ca, (), ExtendedKeyUsageOID.CLIENT_AUTH),
              "other_client": (other_key, other, (), ExtendedKeyUsageOID.CLIENT_AUTH),
              "named": (ca_key, ca, (x509.DNSName("gateway.internal"),), ExtendedKeyUsageOID.SERVER_AUTH)}
    for name, (issuer_key, issuer, sans, usage) in leaves.items():
        key, cert = _leaf(issuer_key, issuer, name, sans, usage, expires_in)
        paths[f"{name}_cert"] = _write(folder / f"{name}.pem", _pem(cert))
        paths[f"{name}_key"] = _write(folder / f"{name}-key.pem", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return Certs(**paths)


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(issuer_key, issuer: x509.Certificate, name: str, sans, usage, expires_in: datetime.timedelta):
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), issuer.subject, key.public_key(),
                        expires_in)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _builder(subject: x509.Name, issuer: x509.Name, public_key,
             expires_in: datetime.timedelta = datetime.timedelta(days=30)) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    not_after = now + expires_in
    not_before = min(now, not_after) - datetime.timedelta(hours=1)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after))


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def install_file(source: Path, target: Path) -> None:
    """Copies source over target as a mounted secret updates: a new file swapped in (a rotation)."""
    staged = target.with_suffix(".new")
    staged.write_bytes(source.read_bytes())
    staged.replace(target)
