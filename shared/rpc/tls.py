"""TLS for our gRPC servers and channels, off unless configured: certificates loaded and checked once at
start-up, the server credentials `listen` serves with, and the one way every client opens a channel.
A certificate that has expired is refused like a file that does not load (shared.rpc.cert_expiry reads the
dates); one that expires within a week is logged as a warning.

grpc takes PEM bytes without looking at them: a missing key, a file that is not PEM or a key that does not
match its certificate surfaces only at the first handshake, as an opaque failure on the peer's side. The
loaders here read each file, check its PEM block and load the set into Python's ssl module (OpenSSL, the
same PEM parsing) so that such a setting is refused at once, in one line naming the flag.

A client verifies the server's certificate against the host part of the address it dials (the gateway
dials a worker's advertised host:port, a worker its --gateway-address): certificates are issued for that
DNS name or IP address (subjectAltName; grpc matches IP entries for an IP literal).

A server picks up renewed certificate files without a restart (cert-manager, a mounted secret): before
each new connection's handshake it compares the files' stat signatures with the ones it serves and, when
they changed, loads and checks them as at start-up. A set that does not load (a rotation caught half
written: the new certificate beside the old key) is logged and the server keeps its current one, trying
again once the files change again. Connections already open keep the certificate they began with.

A long-running client (the gateway dialling workers, a worker its gateways) does the same with its CA and
client certificate through ReloadingClientTls: channels dialled after a rotation use the renewed files, and
the channel owners re-dial the ones they keep open (a channel reconnects with the credentials it was made
with: once the old client certificate expired, or the servers stopped trusting its CA, every reconnection
would fail)."""

from __future__ import annotations

import logging
import os
import re
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from shared.rpc.cert_expiry import leaf_validity, note_in_service

log = logging.getLogger(__name__)
# What a service calls its client settings; qctl passes its own names (its flags and variables).
CLIENT_FLAGS = ("--tls-ca", "--tls-client-cert", "--tls-client-key")
_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:RSA |EC )?PRIVATE KEY-----")
_CERTIFICATE_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.DOTALL)
EXPIRY_WARNING_S = 7 * 86400  # a certificate that expires sooner is logged as a warning when it is loaded
CLOCK_SKEW_S = 300.0  # a certificate valid from later than this is refused as not valid yet


class TlsError(ValueError):
    """A TLS setting that cannot work; the message names the setting and the file."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate chain and key; with client_ca, clients must present a certificate it signed."""

    cert_file: str  # for messages, repr and reloading; the bytes below are what is served
    key_file: str
    client_ca_file: str | None
    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)
    flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")
    # The files' stat signature taken before they were read: a change after that is seen as one.
    signature: tuple = field(default=(), repr=False, compare=False)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that serve these bytes and reload the files when they change (module docstring)."""
        return grpc.dynamic_ssl_server_credentials(self._configuration(), _Reloader(self),
                                                   require_client_authentication=self.client_ca is not None)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.private_key, self.cert_chain)],
                                                         root_certificates=self.client_ca)

    def files(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())


class _ReloadingFiles:
    """TLS settings reloaded when their files change: each check stats them and, when the stat signature moved,
    loads and checks them as at start-up (`_load`). A set that does not load (a rotation caught half written)
    is logged once and the current one kept until the files change again; `generation` counts the reloads."""

    REFUSED = ""  # the log lines' words for a set that does not load, and for one that did
    RELOADED = ""

    def __init__(self, tls: ServerTls | ClientTls | None) -> None:
        self._tls = tls  # None: plaintext, nothing to reload
        self._loaded = () if tls is None else tls.signature or _signature(tls.files())
        self._refused: tuple | None = None  # the signature of a set that did not load: not retried until it changes
        self.generation = 0

    def _reload(self) -> bool:
        """Whether a changed set of files was loaded just now."""
        if self._tls is None:
            return False
        signature = _signature(self._tls.files())
        if signature in (self._loaded, self._refused):
            return False
        try:
            tls = self._load(self._tls)
        except TlsError as exc:
            self._refused = signature
            log.warning("%s; keeping the current ones: %s", self.REFUSED, exc)
            return False
        assert tls is not None  # the same paths as at start-up: what made it TLS is set
        self._tls, self._loaded, self._refused = tls, tls.signature, None
        self.generation += 1
        log.info("%s from %s", self.RELOADED, ", ".join(tls.files()))
        return True

    def _load(self, tls):
        raise NotImplementedError


class _Reloader(_ReloadingFiles):
    """grpc's certificate fetcher: called before every new connection's handshake (on a grpc thread), so it
    only stats the files unless they changed; it must not raise (grpc would fail that handshake)."""

    REFUSED = "TLS certificate files changed but cannot be served"
    RELOADED = "TLS certificate reloaded"

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            return self._tls._configuration() if self._reload() else None
        except Exception:  # noqa: BLE001 - an exception here would fail the client's handshake
            log.exception("checking the TLS certificate files for a change failed; keeping the current ones")
            return None

    def _load(self, tls: ServerTls) -> ServerTls | None:
        return load_server_tls(tls.cert_file, tls.key_file, tls.client_ca_file, tls.flags)


def _signature(paths: Sequence[str]) -> tuple:
    """What changes when a file is rewritten or its symlink is swapped (a mounted secret's update); a file
    that cannot be stat'ed counts as a change, which the reload then reports."""
    signature = []
    for path in paths:
        try:
            st = os.stat(path)
            signature.append((st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError as exc:
            signature.append(exc.errno)
    return tuple(signature)


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The CA certificates a client trusts, and its own certificate and key for servers that require one."""

    ca_file: str
    ca: bytes = field(repr=False)
    cert_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    # Only the health probe sets it: a container's health check dials 127.0.0.1, while the service's
    # certificate names the host other containers reach it by.
    server_name: str | None = None
    cert_file: str | None = None  # where cert_chain and private_key came from (reloading, messages)
    key_file: str | None = None
    flags: tuple[str, str, str] = CLIENT_FLAGS
    signature: tuple = field(default=(), repr=False, compare=False)  # as ServerTls.signature

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)

    def options(self) -> tuple[tuple[str, str], ...]:
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()

    def files(self) -> tuple[str, ...]:
        return (self.ca_file,) + ((self.cert_file, self.key_file) if self.cert_file and self.key_file else ())


class ReloadingClientTls(_ReloadingFiles):
    """A long-running client's TLS: current() is the files' settings as they are now (see _ReloadingFiles; None
    for a plaintext client), and `generation` tells a channel's owner that a channel was dialled with older
    files, to dial it again (see the module docstring)."""

    REFUSED = "TLS client files changed but cannot be used"
    RELOADED = "TLS client files reloaded"

    def current(self) -> ClientTls | None:
        self._reload()
        return self._tls

    def _load(self, tls: ClientTls) -> ClientTls | None:
        return load_client_tls(tls.ca_file, tls.cert_file, tls.key_file, tls.flags, tls.server_name)


def channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to address: over TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=(*options, *tls.options()))


def aio_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to address: over TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=(*options, *tls.options()))


def load_server_tls(cert: Path | str | None, key: Path | str | None, client_ca: Path | str | None,
                    flags: Sequence[str] = ("--tls-cert", "--tls-key", "--tls-client-ca")) -> ServerTls | None:
    """None (plaintext) when neither cert nor key is given; raises TlsError for half a pair, a client CA
    without a certificate, or a file that cannot be read, is not PEM, or does not fit the others."""
    cert_flag, key_flag, ca_flag = flags
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsError(f"{ca_flag} needs {cert_flag} and {key_flag}: client certificates are checked only over TLS")
        return None
    if cert is None or key is None:
        raise TlsError(f"{cert_flag} and {key_flag} go together: give both (TLS) or neither (plaintext)")
    signature = _signature([str(p) for p in (cert, key, client_ca) if p is not None])
    chain, private_key = _read(cert, cert_flag, "certificate"), _read(key, key_flag, "private key")
    _check_pair(cert, key, cert_flag, key_flag)
    _check_dates(chain, cert, cert_flag)
    ca = None
    if client_ca is not None:
        ca = _read(client_ca, ca_flag, "certificate")
        _check_ca(ca, client_ca, ca_flag)
    note_in_service(str(cert), chain)
    return ServerTls(str(cert), str(key), None if client_ca is None else str(client_ca), chain, private_key, ca,
                     tuple(flags), signature)


def load_client_tls(ca: Path | str | None, cert: Path | str | None, key: Path | str | None,
                    flags: Sequence[str] = CLIENT_FLAGS, server_name: str | None = None) -> ClientTls | None:
    """None (plaintext) when no CA is given (None or ""); raises TlsError for a client certificate
    without a CA or without its key, and for a file that cannot be read, is not PEM or does not fit."""
    ca, cert, key = (value or None for value in (ca, cert, key))  # "": a variable set empty turns it off
    ca_flag, cert_flag, key_flag = flags
    if (cert is None) != (key is None):
        raise TlsError(f"{cert_flag} and {key_flag} go together: give both or neither")
    if ca is None:
        if cert is not None:
            raise TlsError(f"{cert_flag} needs {ca_flag}: a client certificate is presented only over TLS")
        return None
    signature = _signature([str(p) for p in (ca, cert, key) if p is not None])
    roots = _read(ca, ca_flag, "certificate")
    _check_ca(roots, ca, ca_flag)
    if cert is None:
        return ClientTls(str(ca), roots, server_name=server_name, flags=tuple(flags), signature=signature)
    chain, private_key = _read(cert, cert_flag, "certificate"), _read(key, key_flag, "private key")
    _check_pair(cert, key, cert_flag, key_flag)
    _check_dates(chain, cert, cert_flag)
    note_in_service(str(cert), chain)
    return ClientTls(str(ca), roots, chain, private_key, server_name, str(cert), str(key), tuple(flags), signature)


def mismatch_hint(details: str, tls: bool, settings: Sequence[str] = CLIENT_FLAGS) -> str:
    """What to add to a failed connection's message when it looks like a TLS mismatch ("" otherwise):
    grpc reports a plaintext server to a TLS client as a failed handshake, and a TLS server (or one that
    wants a client certificate) closes the connection without a word. settings: how the client names its
    CA and client certificate settings (CLIENT_FLAGS' order)."""
    ca_setting, cert_setting = settings[0], settings[1]
    text = details.lower()
    if tls and "wrong_version_number" in text:
        return f"; the server does not speak TLS: if it serves plaintext, leave {ca_setting} unset"
    if tls and "hostname verification" in text:
        return ("; the server's certificate is not issued for the host dialled: its subjectAltName must name "
                "that DNS name or IP address")
    if tls and "certificate_verify_failed" in text:
        return f"; the server's certificate does not verify against {ca_setting} (another CA signed it, or it expired)"
    if tls and "handshake" in text:
        return f"; the TLS handshake failed: check {ca_setting} and the server's certificate"
    if "socket closed" in text or "connection reset" in text:
        if tls:
            return (f"; the server closed the connection: if it requires a client certificate, give one signed by "
                    f"a CA it trusts with {cert_setting}")
        return f"; the server closed the connection: if it serves TLS, give its CA certificate with {ca_setting}"
    return ""


def _check_dates(chain: bytes, path: Path | str, flag: str) -> None:
    """Refuses a certificate that has expired, or is not valid yet (its issuer's clock ahead: a renewal loaded
    then failed every new handshake where the one it replaced was still good): its peers would refuse every
    handshake, saying only that. Warns about one that expires within EXPIRY_WARNING_S."""
    dates = leaf_validity(chain)
    if dates is None:
        return
    not_before, expiry = dates
    if not_before > time.time() + CLOCK_SKEW_S:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(not_before))
        raise TlsError(f"{flag} {path}: the certificate is not valid before {when} (its issuer's clock, or this "
                       "host's, is wrong); keep the current one until then")
    left = expiry - time.time()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expiry))
    if left <= 0:
        raise TlsError(f"{flag} {path}: the certificate expired on {when}; renew it")
    if left < EXPIRY_WARNING_S:
        log.warning("%s %s: the certificate expires on %s, in %.1f days; renew it", flag, path, when, left / 86400)


def certificate_files(*settings: ServerTls | ClientTls | None) -> list[str]:
    """The certificate files (a server's or a client's own, not CA files) of the given TLS settings, each once: one
    certificate for both sides (mTLS) exported its expiry twice with the same labels, a sample Prometheus refuses."""
    files: list[str] = []
    for tls in settings:
        path = tls.cert_file if tls is not None else None
        if path and path not in files:
            files.append(path)
    return files


def _read(path: Path | str, flag: str, kind: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if kind == "certificate" and not _CERTIFICATE.search(data):
        raise TlsError(f"{flag} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    if kind == "private key":
        if b"ENCRYPTED" in data:
            raise TlsError(f"{flag} {path} is an encrypted key: gRPC needs it unencrypted (keep the file "
                           f"readable by the service's user only)")
        if not _PRIVATE_KEY.search(data):
            raise TlsError(f"{flag} {path} holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    return data


def _check_pair(cert: Path | str, key: Path | str, cert_flag: str, key_flag: str) -> None:
    try:
        # password: an encrypted key that slipped past _read fails here instead of prompting on a terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"{key_flag} {key} is not the private key of the certificate in {cert_flag} "
                           f"{cert}") from None
        raise TlsError(f"{cert_flag} {cert} / {key_flag} {key}: cannot be loaded ({exc.reason or exc})") from None


def _check_ca(data: bytes, path: Path | str, flag: str) -> None:
    # Its PEM blocks only: bundles carry titles between them, in UTF-8 in curl's cacert.pem; gRPC skips them.
    blocks = [match.group(0) for match in _CERTIFICATE_BLOCK.finditer(data)]
    if len(blocks) != len(_CERTIFICATE.findall(data)):  # a block begun and not ended: a file caught half written
        raise TlsError(f"{flag} {path}: a certificate in it is incomplete (no -----END CERTIFICATE-----)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=b"\n".join(blocks).decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise TlsError(f"{flag} {path}: its certificates cannot be loaded ({reason})") from None
