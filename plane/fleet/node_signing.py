"""Per-node signed syncs: only a node speaks for itself.

A cluster's enrolment token is held by every node of the cluster, so it cannot tell them
apart. Each sync therefore also carries the sending node's certificate (issued by the
cluster CA), an ECDSA P-256 / SHA-256 signature over the exact body bytes made with that
node's key, and the cluster CA's certificate, which the plane binds to the cluster on first
use. The plane writes a batch only when the certificate verifies against the cluster's CA,
is within its validity, names the batch's `nodeId`, and the signature verifies.

No I/O and no database driver here: the agent signs with it, the plane verifies with it.
The chain check (one signature of the CA over the certificate, and reading its node id) is
cached per (CA, certificate) pair, bounded; the body's signature is verified every time.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

from certs.errors import PinRefused
from certs.identity import describe, spki_sha256, verify_issued_by
from plane.core.errors import SignatureMalformed, SignatureRefused

__all__ = [
    "CLUSTER_CA_HEADER",
    "NODE_CERTIFICATE_HEADER",
    "SIGNATURE_HEADER",
    "ClusterCa",
    "NodeSignature",
    "SyncVerifier",
    "cluster_ca_of_pem",
    "read_signature",
    "sign_sync",
]

NODE_CERTIFICATE_HEADER: Final = "Nvpair-Node-Certificate"  # base64url DER
SIGNATURE_HEADER: Final = "Nvpair-Signature"  # base64url DER ECDSA signature of the body
CLUSTER_CA_HEADER: Final = "Nvpair-Cluster-Ca"  # base64url DER
CACHE: Final = 1024  # (CA, certificate) pairs whose chain check is remembered
_MAX_HEADER: Final = 4 * 1024  # a P-256 certificate is well under 1 KiB of DER
_ALGORITHM: Final = ec.ECDSA(hashes.SHA256())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    """Base64url with or without padding; `ValueError` for anything else."""
    if not text.isascii():
        raise ValueError("not base64url")
    data = text.encode("ascii")
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


def sign_sync(
    body: bytes,
    *,
    key: ec.EllipticCurvePrivateKey,
    cert: x509.Certificate,
    ca: x509.Certificate,
) -> dict[str, str]:
    """The headers that make `body` this node's own: its certificate, its signature over
    exactly these bytes, and the cluster CA that issued the certificate."""
    return {
        NODE_CERTIFICATE_HEADER: _b64(cert.public_bytes(Encoding.DER)),
        SIGNATURE_HEADER: _b64(key.sign(body, _ALGORITHM)),
        CLUSTER_CA_HEADER: _b64(ca.public_bytes(Encoding.DER)),
    }


@dataclass(frozen=True, slots=True)
class NodeSignature:
    """What a sync's headers carry, decoded from base64url (still unverified)."""

    cert_der: bytes
    signature: bytes
    ca_der: bytes


def read_signature(headers: Mapping[str, str]) -> NodeSignature:
    """The signature headers of a request. `SignatureRefused` (403) when there are none --
    an unsigned sync is refused always -- and `SignatureMalformed` (400) when one is
    missing, too long or not base64url."""
    names = (NODE_CERTIFICATE_HEADER, SIGNATURE_HEADER, CLUSTER_CA_HEADER)
    values = [headers.get(name) for name in names]
    if all(value is None for value in values):
        raise SignatureRefused(
            "an unsigned sync is refused: send the node's certificate, its signature of the "
            f"body and the cluster CA ({', '.join(names)})"
        )
    decoded = []
    for name, value in zip(names, values, strict=True):
        if value is None:
            raise SignatureMalformed(f"{name} is missing")
        try:
            if len(value) > _MAX_HEADER:
                raise ValueError("too long")
            decoded.append(_unb64(value.strip()))
        except (ValueError, binascii.Error):
            raise SignatureMalformed(f"{name} is not base64url of at most 4 KiB") from None
    return NodeSignature(cert_der=decoded[0], signature=decoded[1], ca_der=decoded[2])


@dataclass(frozen=True, slots=True)
class ClusterCa:
    """The CA a sync's certificate verified against: what the plane binds to the cluster
    (compared by `spki_sha256`, the key being the trust) and keeps (`der`)."""

    spki_sha256: bytes
    der: bytes


@dataclass(frozen=True, slots=True)
class _Issued:
    """A certificate the CA issued, as far as it matters for a sync."""

    node_id: str
    not_before: datetime.datetime
    not_after: datetime.datetime
    key: ec.EllipticCurvePublicKey
    ca: ClusterCa


class SyncVerifier:
    """Checks that a sync's body is the named node's own; remembers verified chains."""

    def __init__(self, cache_size: int = CACHE) -> None:
        self._issued: OrderedDict[bytes, _Issued] = OrderedDict()
        self._cache_size = cache_size

    def check(
        self, signed: NodeSignature, body: bytes, *, node_id: str, now: datetime.datetime
    ) -> ClusterCa:
        """The CA, when `body` was signed by `node_id`'s key, certified by `signed.ca_der`
        and valid at `now`; `SignatureRefused` (403) saying why not otherwise.

        Whether that CA is the cluster's is the store's to check: it binds the first."""
        issued = self._issued_by(signed.cert_der, signed.ca_der)
        if not issued.not_before <= now <= issued.not_after:
            raise SignatureRefused(
                f"the node certificate is not valid now (valid {issued.not_before.isoformat()} "
                f"to {issued.not_after.isoformat()})"
            )
        if issued.node_id != node_id:
            raise SignatureRefused(
                f"a sync in {node_id}'s name signed by {issued.node_id}: a node syncs only "
                "for itself"
            )
        try:
            issued.key.verify(signed.signature, body, _ALGORITHM)
        except InvalidSignature:
            raise SignatureRefused(
                f"the body's signature does not verify with {issued.node_id}'s certificate"
            ) from None
        return issued.ca

    def _issued_by(self, cert_der: bytes, ca_der: bytes) -> _Issued:
        """The chain check, cached by both certificates' bytes (a refusal is not cached)."""
        digest = hashlib.sha256(ca_der + b"\0" + cert_der).digest()
        issued = self._issued.get(digest)
        if issued is not None:
            self._issued.move_to_end(digest)
            return issued
        issued = _check_chain(cert_der, ca_der)
        self._issued[digest] = issued
        if len(self._issued) > self._cache_size:
            self._issued.popitem(last=False)
        return issued


def _check_chain(cert_der: bytes, ca_der: bytes) -> _Issued:
    try:
        cert = x509.load_der_x509_certificate(cert_der)
        ca = x509.load_der_x509_certificate(ca_der)
    except ValueError:
        raise SignatureMalformed("a certificate header is not a DER certificate") from None
    if not _is_ca(ca):
        raise SignatureRefused("the cluster CA certificate is not a CA")
    if not verify_issued_by(cert, ca):
        raise SignatureRefused("the node certificate was not issued by the cluster CA sent")
    try:
        node_id = describe(cert).node_id
    except PinRefused as exc:
        raise SignatureRefused(f"the node certificate names no node: {exc}") from None
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise SignatureRefused("the node certificate's key is not EC P-256")
    return _Issued(
        node_id=node_id,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        key=key,
        ca=ClusterCa(spki_sha256=spki_sha256(ca), der=ca_der),
    )


def cluster_ca_of_pem(pem: bytes) -> ClusterCa:
    """The CA an admin binds at enrolment (`enrol-cluster --ca`); `ValueError` when `pem`
    is not one CA certificate."""
    ca = x509.load_pem_x509_certificate(pem)
    if not _is_ca(ca):
        raise ValueError("the certificate is not a CA")
    return ClusterCa(spki_sha256=spki_sha256(ca), der=ca.public_bytes(Encoding.DER))


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except (x509.ExtensionNotFound, ValueError):
        return False
