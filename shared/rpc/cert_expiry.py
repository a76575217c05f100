"""When a PEM certificate chain expires: the earliest notAfter of its certificates, read from their DER
(RFC 5280: Certificate > tbsCertificate > validity > notAfter) without a dependency beyond the standard
library, whose ssl module decodes only CA certificates.

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


def chain_expiry(pem: bytes) -> float | None:
    """Epoch seconds of the earliest notAfter among the PEM certificates; None when there is none, or one
    does not parse (the TLS library judges such a file; this module only reads dates)."""
    times = []
    for block in _PEM_CERTIFICATE.findall(pem):
        try:
            times.append(not_after(base64.b64decode(b"".join(block.split()), validate=True)))
        except (binascii.Error, ValueError, IndexError):
            return None
    return min(times) if times else None


def not_after(der: bytes) -> float:
    """The notAfter of one DER certificate, epoch seconds; ValueError or IndexError when it is not one."""
    tag, start, _ = _element(der, 0)
    _expect(tag, _SEQUENCE, "Certificate")
    tag, pos, _ = _element(der, start)
    _expect(tag, _SEQUENCE, "tbsCertificate")
    tag, _, end = _element(der, pos)
    if tag == _VERSION:  # [0] EXPLICIT version, absent in v1 certificates
        pos = end
    for _ in range(3):  # serialNumber, signature, issuer
        _, _, pos = _element(der, pos)
    tag, validity, _ = _element(der, pos)
    _expect(tag, _SEQUENCE, "validity")
    _, _, after = _element(der, validity)  # notBefore
    tag, start, end = _element(der, after)
    return _time(tag, der[start:end].decode("ascii"))


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
    """Prometheus collector: qserve_<service>_tls_certificate_expiry_timestamp_seconds{file} of each certificate
    file, read at each scrape (a renewed file shows at once; a file that cannot be read or parsed has no sample)."""

    def __init__(self, service: str, files: list[str]):
        self._name = f"qserve_{service}_tls_certificate_expiry_timestamp_seconds"
        self._files = files

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name,
                                   "When the certificate in the file expires (the earliest notAfter of its chain), "
                                   "unix seconds", labels=["file"])
        for path in self._files:
            try:
                expiry = chain_expiry(Path(path).read_bytes())
            except OSError:
                continue
            if expiry is not None:
                family.add_metric([path], expiry)
        yield family
