"""A node's record, signed by its owner: members take a record for node X only when it
verifies against X's pinned certificate, and only with a generation within a bounded skew of
their own clock. A pinned member can otherwise speak for another (new addresses, a cordon,
a generation of 2^62 that no later record beats) and draw its traffic.

A removal is signed by the member that made it and carries that member's certificate, so a
member checks it against the cluster CA alone -- whoever relays it, whether or not it ever
pinned the remover, and after the remover is itself removed (a removal it made before its
own still stands; one dated after is refused).

The signature is ECDSA P-256 with SHA-256 over the record's JSON encoding with an empty
`signature`. A member checks it over **the bytes as received** with the signature's value
emptied (`signed_payload`), not over its own re-encoding: a record or fact signed by a
member of a later release, with fields this release does not know, verifies here, and is
relayed as those same bytes (docs/upgrade.md). Verifications are cached by the signed bytes
and the key, bounded.
"""

from __future__ import annotations

import base64
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Protocol, TypeVar

import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from certs import CertsError
from certs.identity import cert_pem, describe, load_cert, verify_issued_by
from facts.records import NodeRecord, Removal
from facts.wire import Speaks

__all__ = [
    "MAX_SKEW_MS",
    "RecordVerifier",
    "Statement",
    "removal_bytes",
    "sign_record",
    "sign_removal",
    "sign_speaks",
    "sign_statement",
    "signed_bytes",
    "signed_payload",
    "statement_bytes",
]

MAX_SKEW_MS: Final = 5 * 60 * 1000  # a generation (epoch ms) further ahead is refused
CACHE: Final = 4096  # verified (record, key) pairs remembered

_encode: Final = msgspec.json.Encoder().encode
_ALGORITHM: Final = ec.ECDSA(hashes.SHA256())
_DER: Final = Encoding.DER
_SPKI: Final = PublicFormat.SubjectPublicKeyInfo


def signed_bytes(record: NodeRecord) -> bytes:
    """What the signature covers: the record with an empty `signature`."""
    return _encode(msgspec.structs.replace(record, signature=""))


def signed_payload(raw: bytes, signature: str) -> bytes | None:
    """What a signature over `raw` (a record or fact as received) covers: `raw` with the
    signature's value emptied. None when `raw` does not hold that value exactly once as a
    `"signature"` member (the signer's encoder writes it once, unescaped): such bytes are
    refused, never guessed at."""
    try:
        needle = b'"signature":"' + signature.encode("ascii") + b'"'
    except UnicodeEncodeError:
        return None
    at = raw.find(needle)
    if at < 0 or raw.find(needle, at + 1) >= 0:
        return None
    return raw[:at] + b'"signature":""' + raw[at + len(needle) :]


def _payload(fact: Statement | NodeRecord | Speaks, raw: bytes | None) -> bytes | None:
    if raw is None:  # made here: this release's encoding is the one signed
        return _encode(msgspec.structs.replace(fact, signature=""))  # type: ignore[type-var]
    return signed_payload(raw, fact.signature)


def sign_record(record: NodeRecord, key: ec.EllipticCurvePrivateKey) -> NodeRecord:
    """`record` with its owner's signature."""
    signature = key.sign(signed_bytes(record), _ALGORITHM)
    return msgspec.structs.replace(
        record, signature=base64.urlsafe_b64encode(signature).decode("ascii")
    )


class Statement(Protocol):
    """A cluster fact signed by the member that made it (a removal, a deployment): the
    signer's node id, its certificate (PEM) and its signature over the rest."""

    @property
    def by(self) -> str: ...
    @property
    def byCert(self) -> str: ...
    @property
    def signature(self) -> str: ...


S = TypeVar("S", bound=Statement)


def statement_bytes(statement: Statement) -> bytes:
    """What a statement's signature covers: the statement with an empty `signature`."""
    return _encode(msgspec.structs.replace(statement, signature=""))  # type: ignore[type-var]


def sign_statement(statement: S, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> S:
    """`statement` as said by the member holding `key` and `cert` (its node id is `by`)."""
    unsigned: S = msgspec.structs.replace(  # type: ignore[type-var]
        statement, by=describe(cert).node_id, byCert=cert_pem(cert).decode("ascii"), signature=""
    )
    signature = key.sign(statement_bytes(unsigned), _ALGORITHM)
    signed: S = msgspec.structs.replace(  # type: ignore[type-var]
        unsigned, signature=base64.urlsafe_b64encode(signature).decode("ascii")
    )
    return signed


def sign_speaks(statement: Speaks, key: ec.EllipticCurvePrivateKey) -> Speaks:
    """`statement` (what this member speaks) with its owner's signature."""
    unsigned = msgspec.structs.replace(statement, signature="")
    signature = key.sign(_encode(unsigned), _ALGORITHM)
    return msgspec.structs.replace(
        unsigned, signature=base64.urlsafe_b64encode(signature).decode("ascii")
    )


def removal_bytes(removal: Removal) -> bytes:
    """What a removal's signature covers."""
    return statement_bytes(removal)


def sign_removal(
    removal: Removal, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> Removal:
    """`removal` as a statement of the member holding `key` and `cert`."""
    return sign_statement(removal, key, cert)


class RecordVerifier:
    """Checks records against their owners' keys; remembers what verified."""

    def __init__(self) -> None:
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self.refused = 0

    def why_not(
        self,
        record: NodeRecord,
        key: ec.EllipticCurvePublicKey | None,
        *,
        now_ms: int,
        raw: bytes | None = None,
    ) -> str | None:
        """None when `record` is its owner's, signed with `key`, and not from the future;
        else why it is refused (counted). `raw`: the record as received (None: made here)."""
        why = self._check(record, key, now_ms, raw)
        if why is not None:
            self.refused += 1
        return why

    def _check(
        self,
        record: NodeRecord,
        key: ec.EllipticCurvePublicKey | None,
        now_ms: int,
        raw: bytes | None,
    ) -> str | None:
        if key is None:
            return f"a record for {record.nodeId}, whose key this node does not hold"
        if record.generation > now_ms + MAX_SKEW_MS:
            return f"a record for {record.nodeId} from the future (generation {record.generation})"
        if not record.signature:
            return f"an unsigned record for {record.nodeId}"
        point = key.public_bytes(_DER, _SPKI)
        payload = _payload(record, raw)
        if payload is None or not self._verifies(payload, point, record.signature, lambda: key):
            return f"a record for {record.nodeId} that {record.nodeId} did not sign"
        return None

    def speaks_why_not(
        self, statement: Speaks, key: ec.EllipticCurvePublicKey | None, *, raw: bytes | None
    ) -> str | None:
        """None when `statement` (what a member speaks) is its owner's, signed with `key`;
        else why it is refused (counted)."""
        who = statement.nodeId
        why = None
        if key is None:
            why = f"what {who} speaks, whose key this node does not hold"
        else:
            payload = _payload(statement, raw)
            point = key.public_bytes(_DER, _SPKI)
            if payload is None or not self._verifies(
                payload, point, statement.signature, lambda: key
            ):
                why = f"what {who} speaks, in a statement {who} did not sign"
        if why is not None:
            self.refused += 1
        return why

    def removal_why_not(
        self,
        removal: Removal,
        ca: x509.Certificate,
        *,
        removed_at: int | None = None,
        raw: bytes | None = None,
    ) -> str | None:
        """None when `removal` is signed by a member of `ca`'s cluster whose certificate it
        carries; else why it is refused (counted). `removed_at` is when the signer was itself
        removed, if it was: a removal it signed later is refused."""
        why = self._check_removal(removal, ca, removed_at, raw)
        if why is not None:
            self.refused += 1
        return why

    def _check_removal(
        self, removal: Removal, ca: x509.Certificate, removed_at: int | None, raw: bytes | None
    ) -> str | None:
        what = f"a removal of {removal.nodeId}"
        if removed_at is not None and removal.removedAt >= removed_at and removal.by:
            return f"{what} signed by {removal.by} after {removal.by} was itself removed"
        return self._check_statement(removal, ca, what, raw)

    def statement_why_not(
        self, statement: Statement, ca: x509.Certificate, what: str, *, raw: bytes | None = None
    ) -> str | None:
        """None when `statement` is signed by a member of `ca`'s cluster whose certificate
        it carries; else why it is refused (counted). `what` names it in the reason; `raw`
        is the statement as received (None: made here)."""
        why = self._check_statement(statement, ca, what, raw)
        if why is not None:
            self.refused += 1
        return why

    def _check_statement(
        self, statement: Statement, ca: x509.Certificate, what: str, raw: bytes | None
    ) -> str | None:
        by, pem = statement.by, statement.byCert
        if not (by and pem and statement.signature):
            return f"{what} that no member signed"
        anchor = ca.public_bytes(_DER)

        def signer() -> ec.EllipticCurvePublicKey | None:
            try:
                cert = load_cert(pem.encode())
                if describe(cert).node_id != by or not verify_issued_by(cert, ca):
                    return None
            except (ValueError, CertsError):
                return None
            key = cert.public_key()
            return key if isinstance(key, ec.EllipticCurvePublicKey) else None

        context = anchor + b"\0" + pem.encode()
        payload = _payload(statement, raw)
        if payload is None or not self._verifies(payload, context, statement.signature, signer):
            return f"{what} that {by} (a member of this cluster) did not sign"
        return None

    def _verifies(
        self,
        payload: bytes,
        context: bytes,
        signature_b64: str,
        key: Callable[[], ec.EllipticCurvePublicKey | None],
    ) -> bool:
        """Whether `signature_b64` over `payload` verifies with `key()` (None: it does not);
        a success is remembered by (payload, context, signature), bounded."""
        digest = hashlib.sha256(payload + b"\0" + context + b"\0" + signature_b64.encode()).digest()
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return True
        public = key()
        if public is None:
            return False
        try:
            signature = base64.urlsafe_b64decode(signature_b64.encode("ascii"))
            public.verify(signature, payload, _ALGORITHM)
        except (ValueError, InvalidSignature):
            return False
        self._verified[digest] = None
        if len(self._verified) > CACHE:
            self._verified.popitem(last=False)
        return True
