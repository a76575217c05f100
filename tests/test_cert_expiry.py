"""Certificate dates: read from the DER without a dependency (shared/rpc/cert_expiry.py), an expired
certificate refused at start-up and on a reload, one about to expire logged, and the expiry exported."""

from __future__ import annotations

import datetime
import logging
import time

import pytest
from cryptography import x509

from services.gateway.config import FallbackBudget, GatewayConfig
from services.gateway.server import GatewayServer
from shared.registry import sqlite_url
from shared.rpc.cert_expiry import CertificateExpiry, leaf_validity
from shared.rpc.tls import ReloadingClientTls, TlsError, load_client_tls, load_server_tls
from tests.tls.certs import install_file, make_certs

DAY = datetime.timedelta(days=1)


def _not_after(path) -> float:
    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc.timestamp()


@pytest.mark.parametrize("expires_in", [DAY * 30, -DAY, DAY * 365 * 40])  # 40 years: a GeneralizedTime (2050+)
def test_the_expiry_read_from_the_der_is_the_certificates_not_after(tmp_path, expires_in):
    certs = make_certs(tmp_path, expires_in)
    for path in (certs.server_cert, certs.client_cert, certs.ca):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        assert leaf_validity(path.read_bytes()) == (cert.not_valid_before_utc.timestamp(), _not_after(path))
    chain = certs.server_cert.read_bytes() + certs.ca.read_bytes()  # a leaf and its CA: the leaf's dates
    assert leaf_validity(chain)[1] == _not_after(certs.server_cert)


def test_what_is_not_a_certificate_has_no_expiry():
    assert leaf_validity(b"") is None
    assert leaf_validity(b"-----BEGIN CERTIFICATE-----\nbm90IGRlcg==\n-----END CERTIFICATE-----\n") is None
    assert leaf_validity(b"-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n") is None


def test_an_expired_certificate_further_down_the_chain_does_not_refuse_a_good_leaf(tmp_path):
    """A full chain ending in an expired cross-signed root (AddTrust 2020, DST Root X3 2021): peers trusting the
    newer root verify it, but the earliest notAfter of the file refused it at start-up and on every renewal."""
    good, old = make_certs(tmp_path / "good"), make_certs(tmp_path / "old", -DAY)
    fullchain = tmp_path / "fullchain.pem"
    fullchain.write_bytes(good.server_cert.read_bytes() + good.ca.read_bytes() + old.server_cert.read_bytes())
    assert load_server_tls(fullchain, good.server_key, None) is not None
    family = list(CertificateExpiry("gateway", [str(fullchain)]).collect())[0]
    assert [sample.value for sample in family.samples] == [_not_after(good.server_cert)]


def test_a_certificate_not_valid_yet_is_refused(tmp_path):
    """Its issuer's clock ahead: loaded on a renewal, every new handshake failed where the one it replaced was good."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "early")])
    start = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=2)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(start + DAY * 30)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "early.pem", tmp_path / "early-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    with pytest.raises(TlsError, match=f"--tls-cert {cert_file}: the certificate is not valid before"):
        load_server_tls(cert_file, key_file, None)


def test_the_expiry_exported_is_the_certificate_in_service_not_a_renewal_refused(tmp_path):
    """A renewal that does not load (its key not the certificate's) keeps the old certificate in service; the
    metric read the file, so the alert on the certificate about to expire went quiet."""
    soon, renewed = make_certs(tmp_path / "soon", DAY * 2), make_certs(tmp_path / "renewed", DAY * 90)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(soon.server_cert.read_bytes())
    key.write_bytes(soon.server_key.read_bytes())
    tls = ReloadingClientTls(load_client_tls(soon.ca, cert, key))
    install_file(renewed.server_cert, cert)  # its key not installed (yet): refused
    assert tls.current().cert_chain == soon.server_cert.read_bytes()
    family = list(CertificateExpiry("gateway", [str(cert)]).collect())[0]
    assert [sample.value for sample in family.samples] == [_not_after(soon.server_cert)]
    install_file(renewed.server_key, key)
    assert tls.current().cert_chain == renewed.server_cert.read_bytes()
    family = list(CertificateExpiry("gateway", [str(cert)]).collect())[0]
    assert [sample.value for sample in family.samples] == [_not_after(renewed.server_cert)]


def test_an_expired_certificate_is_refused_naming_the_flag_and_the_date(tmp_path):
    expired = make_certs(tmp_path / "expired", -DAY)
    when = time.strftime("%Y-%m-%d", time.gmtime(_not_after(expired.server_cert)))
    with pytest.raises(TlsError, match=f"--tls-cert {expired.server_cert}: the certificate expired on {when}"):
        load_server_tls(expired.server_cert, expired.server_key, None)
    with pytest.raises(TlsError, match="--tls-client-cert .*: the certificate expired on"):
        load_client_tls(expired.ca, expired.client_cert, expired.client_key)


def test_a_certificate_about_to_expire_is_loaded_with_a_warning(tmp_path, caplog):
    soon = make_certs(tmp_path, DAY * 2)
    with caplog.at_level(logging.WARNING, logger="shared.rpc.tls"):
        assert load_server_tls(soon.server_cert, soon.server_key, None) is not None
    assert any("expires on" in r.getMessage() and "in 2.0 days" in r.getMessage() for r in caplog.records)


def test_an_expired_renewal_is_not_taken_by_a_reloading_client(tmp_path, caplog):
    good, expired = make_certs(tmp_path / "good"), make_certs(tmp_path / "expired", -DAY)
    cert, key = tmp_path / "client.pem", tmp_path / "client-key.pem"
    cert.write_bytes(good.client_cert.read_bytes())
    key.write_bytes(good.client_key.read_bytes())
    tls = ReloadingClientTls(load_client_tls(good.ca, cert, key))
    install_file(expired.client_cert, cert)
    install_file(expired.client_key, key)
    with caplog.at_level(logging.WARNING, logger="shared.rpc.tls"):
        assert tls.current().cert_chain == good.client_cert.read_bytes() and tls.generation == 0
    assert any("expired on" in r.getMessage() for r in caplog.records)


def test_the_services_export_when_their_certificates_expire(tmp_path):
    certs = make_certs(tmp_path / "certs")
    gateway = GatewayServer(GatewayConfig(
        registry_url=sqlite_url(tmp_path / "registry.db"), listen="127.0.0.1:0", budget=FallbackBudget(enabled=False),
        tls=load_server_tls(certs.server_cert, certs.server_key, None),
        worker_tls=load_client_tls(certs.ca, certs.client_cert, certs.client_key)))
    samples = {sample.labels["file"]: sample.value for family in gateway.metrics.registry.collect()
               if family.name == "qserve_gateway_tls_certificate_expiry_timestamp_seconds" for sample in family.samples}
    assert samples == {str(certs.server_cert): _not_after(certs.server_cert),
                       str(certs.client_cert): _not_after(certs.client_cert)}
    assert list(CertificateExpiry("gateway", [str(tmp_path / "missing.pem")]).collect())[0].samples == []


def test_one_certificate_for_both_sides_is_one_expiry_series():
    """mTLS often uses one certificate to serve and to dial: two samples with the same labels, which Prometheus
    refuses, made the renewal alert's metric unusable."""
    from types import SimpleNamespace

    from shared.rpc.tls import certificate_files

    both = SimpleNamespace(cert_file="/etc/qserve/node.pem")
    assert certificate_files(both, None, SimpleNamespace(cert_file=None), both) == ["/etc/qserve/node.pem"]
