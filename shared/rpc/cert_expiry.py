"""When a PEM certificate chain's own certificate (its first, the leaf) is valid: its notBefore and notAfter,
read from the DER (RFC 5280: Certificate > tbsCertificate > validity) without a dependency beyond the standard
library, whose ssl module decodes only CA certificates. The leaf's, not the earliest of the chain: an expired
cross-signed root left in a full chain (the AddTrust 2020, DST Root X3 2021 pattern) does not stop peers that
trust the newer root, and judged by it a working certificate was refused at start-up and on every renewal.

Used by shared/rpc/tls.py to refuse an expired certificate at start-up (and on a reload) with a line that says
so, instead of the peer's opaque handshake failure, and by the services' metrics
(qserve_<service>_tls_certificate_expiry_timestamp_seconds) so that an alert can fire before the renewal is late."""

from __future__ import annotations

import base64
import binascii
import calendar
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily

_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _VERSION, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18


# The certificate in service for each certificate file (its leaf's validity), as the TLS loaders last loaded it:
# a renewal refused (a key that does not match, a half-written file) keeps the old certificate in service, and
# the metric must show that one, whose expiry is coming, not the file's.
_in_service: dict[str, tuple[float, float]] = {}


def leaf_validity(pem: bytes) -> tuple[float, float] | None:
    """(notBefore, notAfter) of the first PEM certificate, epoch seconds; None when there is none, or it does
    not parse (the TLS library judges such a file; this module only reads dates)."""
    block = next(iter(_PEM_CERTIFICATE.findall(pem)), None)
    if block is None:
        return None
    try:
        return validity(base64.b64decode(b"".join(block.split()), validate=True))
    except (binascii.Error, ValueError, IndexError):
        return None


def note_in_service(path: str, pem: bytes) -> None:
    """Records the certificate of path that a TLS loader has just loaded (and its service now uses)."""
    dates = leaf_validity(pem)
    if dates is not None:
        _in_service[path] = dates


def validity(der: bytes) -> tuple[float, float]:
    """(notBefore, notAfter) of one DER certificate, epoch seconds; ValueError or IndexError when it is not one."""
    tag, start, _ = _element(der, 0)
    _expect(tag, _SEQUENCE, "Certificate")
    tag, pos, _ = _element(der, start)
    _expect(tag, _SEQUENCE, "tbsCertificate")
    tag, _, end = _element(der, pos)
    if tag == _VERSION:  # [0] EXPLICIT version, absent in v1 certificates
        pos = end
    for _ in range(3):  # serialNumber, signature, issuer
        _, _, pos = _element(der, pos)
    tag, dates, _ = _element(der, pos)
    _expect(tag, _SEQUENCE, "validity")
    tag, start, after = _element(der, dates)
    not_before = _time(tag, der[start:after].decode("ascii"))
    tag, start, end = _element(der, after)
    return not_before, _time(tag, der[start:end].decode("ascii"))


def _element(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, start of the content, end of the content) of the DER element at pos."""
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        size = length & 0x7F
        if not 1 <= size <= 4:
            raise ValueError(f"unsupported DER length of {size} bytes")
        length = int.from_bytes(der[pos:pos + size], "big")
        pos += size
    if pos + length > len(der):
        raise ValueError("DER element runs past the end")
    return tag, pos, pos + length


def _expect(tag: int, wanted: int, what: str) -> None:
    if tag != wanted:
        raise ValueError(f"{what}: DER tag {tag:#x}, expected {wanted:#x}")


def _time(tag: int, text: str) -> float:
    """UTCTime YYMMDDHHMMSSZ (years 50-99 are 19xx: RFC 5280) or GeneralizedTime YYYYMMDDHHMMSSZ."""
    if tag == _UTC_TIME and re.fullmatch(r"\d{12}Z", text):
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME or not re.fullmatch(r"\d{14}Z", text):
        raise ValueError(f"certificate time {text!r} (DER tag {tag:#x}) is not a UTCTime or GeneralizedTime in Z")
    fields = (int(text[0:4]), int(text[4:6]), int(text[6:8]), int(text[8:10]), int(text[10:12]), int(text[12:14]))
    return float(calendar.timegm(fields))


class CertificateExpiry:
    """Prometheus collector: qserve_<service>_tls_certificate_expiry_timestamp_seconds{file} of the certificate in
    service for each certificate file (note_in_service: a renewal shows once loaded, a refused one not at all);
    read from the file where no loader of this process has loaded it."""

    def __init__(self, service: str, files: list[str]):
        self._name = f"qserve_{service}_tls_certificate_expiry_timestamp_seconds"
        self._files = files

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name,
                                   "When the certificate in service from the file expires (its notAfter), unix seconds",
                                   labels=["file"])
        for path in self._files:
            dates = _in_service.get(path)
            if dates is None:
                try:
                    dates = leaf_validity(Path(path).read_bytes())
                except OSError:
                    continue
            if dates is not None:
                family.add_metric([path], dates[1])
        yield family
