"""Keys and certificates: the cluster CA, node keys, CSRs, signing and pins.

Everything is EC P-256 and SHA-256. A node certificate carries the node id as a SAN URI
(`urn:nvpair:node:nod_…`), a DNS SAN `nod_….nvpair.internal` that clients check when they
expect that node, and the node's own DNS names and IP addresses. It is valid for both TLS
server and client authentication: members are peers.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.errors import BadCertificate, PinRefused
from certs.ids import DNS_SUFFIX, node_dns_name, node_id_from_uri, node_uri

# A host name an operator may put in a certificate: letters, digits and hyphens in labels of
# at most 63, no wildcard (checked lower-cased).
_DNS_NAME: Final = re.compile(
    r"(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*"
)

__all__ = [
    "CA_VALIDITY",
    "NODE_VALIDITY",
    "NodeCert",
    "ca_fingerprint",
    "cert_pem",
    "describe",
    "issue_node_cert",
    "key_pem",
    "load_cert",
    "load_key",
    "make_ca",
    "make_csr",
    "new_key",
    "operator_sans",
    "spki_sha256",
    "spki_sha256_of_der",
    "verify_issued_by",
]

CA_VALIDITY: Final = datetime.timedelta(days=3650)
NODE_VALIDITY: Final = datetime.timedelta(days=365)
_BACKDATE: Final = datetime.timedelta(minutes=5)  # tolerate clocks a little behind ours

PrivateKey = ec.EllipticCurvePrivateKey


def new_key() -> PrivateKey:
    """A fresh EC P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: PrivateKey) -> bytes:
    """PKCS#8 PEM, unencrypted: the file's mode protects it."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    """PEM of a certificate."""
    return cert.public_bytes(serialization.Encoding.PEM)


def load_key(data: bytes) -> PrivateKey:
    """Parse a PEM private key; only EC P-256 keys are ours (`BadCertificate` otherwise)."""
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: a key that wants a password
        raise BadCertificate(f"not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise BadCertificate("not an EC P-256 private key")
    return key


def load_cert(data: bytes) -> x509.Certificate:
    """Parse one PEM certificate (`BadCertificate` when it is not one)."""
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise BadCertificate(f"not a PEM certificate ({exc})") from exc


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(
    name: str, *, now: datetime.datetime | None = None
) -> tuple[PrivateKey, x509.Certificate]:
    """A new cluster CA: a self-signed certificate that may sign node certificates only."""
    now = now or _now()
    key = new_key()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nvpair"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{name} cluster CA"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + CA_VALIDITY)
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
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_csr(
    key: PrivateKey, name: str, sans: Iterable[str] = ()
) -> x509.CertificateSigningRequest:
    """A CSR for a node named `name`, asking for extra DNS names / IPs in `sans`."""
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    )
    general = _general_names(sans)
    if general:
        builder = builder.add_extension(x509.SubjectAlternativeName(general), critical=False)
    return builder.sign(key, hashes.SHA256())


def _general_names(sans: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    return names


def issue_node_cert(
    *,
    ca_key: PrivateKey,
    ca_cert: x509.Certificate,
    public_key: ec.EllipticCurvePublicKey,
    node_id: str,
    name: str,
    sans: Iterable[str] = (),
    now: datetime.datetime | None = None,
) -> x509.Certificate:
    """Sign a node certificate that carries `node_id`; one year by default."""
    now = now or _now()
    if (
        not isinstance(public_key, ec.EllipticCurvePublicKey)
        or public_key.curve.name != "secp256r1"
    ):
        raise PinRefused("node keys must be EC P-256")
    general: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(node_uri(node_id)),
        x509.DNSName(node_dns_name(node_id)),
        *_general_names(operator_names(sans)),
    ]
    not_after = min(now + NODE_VALIDITY, ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(general), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def operator_names(sans: Iterable[str]) -> list[str]:
    """The extra names an operator may have in a node certificate: IP addresses, and DNS
    names outside the cluster's own namespace. A name under `.nvpair.internal` in any case
    (DNS matching ignores case: `NOD_X.NVPAIR.INTERNAL` is node X's name), a wildcard or a
    malformed name is dropped: the node-id names are the issuer's to add, never a CSR's."""
    kept: list[str] = []
    for san in sans:
        try:
            kept.append(str(ipaddress.ip_address(san)))
            continue
        except ValueError:
            pass
        name = san.rstrip(".").lower()
        if name.endswith(DNS_SUFFIX) or name == DNS_SUFFIX[1:] or not _DNS_NAME.fullmatch(name):
            continue
        kept.append(san)
    return kept


def operator_sans(extensions: x509.Extensions) -> list[str]:
    """The DNS names and IPs in a certificate or CSR, without the node-id name we add."""
    try:
        sans = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    names = [
        *sans.get_values_for_type(x509.DNSName),
        *map(str, sans.get_values_for_type(x509.IPAddress)),
    ]
    return operator_names(names)


def spki_sha256(cert: x509.Certificate) -> bytes:
    """The pin: SHA-256 of the certificate's SubjectPublicKeyInfo."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).digest()


@functools.lru_cache(maxsize=1024)
def spki_sha256_of_der(der: bytes) -> bytes:
    """The pin of a DER certificate, as a TLS peer presents it; cached (bounded)."""
    return spki_sha256(x509.load_der_x509_certificate(der))


def ca_fingerprint(ca_cert: x509.Certificate) -> bytes:
    """SHA-256 of the CA certificate's DER: what an invite carries."""
    return ca_cert.fingerprint(hashes.SHA256())


def verify_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    """Whether `cert` carries a valid signature of `ca_cert` (validity dates aside)."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


@dataclass(frozen=True, slots=True)
class NodeCert:
    """What a node certificate says about its member."""

    node_id: str
    name: str
    pin: bytes
    not_after: datetime.datetime


def describe(cert: x509.Certificate) -> NodeCert:
    """Read the node id, name and pin out of a node certificate."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PinRefused("certificate carries no node id (no SAN URI)") from None
    ids = [
        node_id_from_uri(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier)
    ]
    found = [node_id for node_id in ids if node_id is not None]
    if len(found) != 1:
        raise PinRefused("certificate must carry exactly one nvpair node id")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    name = str(names[0].value) if names else found[0]
    return NodeCert(
        node_id=found[0], name=name, pin=spki_sha256(cert), not_after=cert.not_valid_after_utc
    )
