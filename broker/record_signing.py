"""A node's record, signed by its owner: members take a record for node X only when it
verifies against X's pinned certificate, and only with a generation within a bounded skew of
their own clock. A pinned member can otherwise speak for another (new addresses, a cordon,
a generation of 2^62 that no later record beats) and draw its traffic.

The signature is ECDSA P-256 with SHA-256 over the record's JSON encoding with an empty
`signature` (msgspec encodes a struct's fields in their declared order, so the same record
encodes to the same bytes on every member). Verifications are cached by the signed bytes
and the key, bounded.
"""

from __future__ import annotations

import base64
import hashlib
from collections import OrderedDict
from typing import Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .records import NodeRecord

__all__ = ["MAX_SKEW_MS", "RecordVerifier", "sign_record", "signed_bytes"]

MAX_SKEW_MS: Final = 5 * 60 * 1000  # a generation (epoch ms) further ahead is refused
CACHE: Final = 4096  # verified (record, key) pairs remembered

_encode: Final = msgspec.json.Encoder().encode
_ALGORITHM: Final = ec.ECDSA(hashes.SHA256())
_DER: Final = Encoding.DER
_SPKI: Final = PublicFormat.SubjectPublicKeyInfo


def signed_bytes(record: NodeRecord) -> bytes:
    """What the signature covers: the record with an empty `signature`."""
    return _encode(msgspec.structs.replace(record, signature=""))


def sign_record(record: NodeRecord, key: ec.EllipticCurvePrivateKey) -> NodeRecord:
    """`record` with its owner's signature."""
    signature = key.sign(signed_bytes(record), _ALGORITHM)
    return msgspec.structs.replace(
        record, signature=base64.urlsafe_b64encode(signature).decode("ascii")
    )


class RecordVerifier:
    """Checks records against their owners' keys; remembers what verified."""

    def __init__(self) -> None:
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self.refused = 0

    def why_not(
        self, record: NodeRecord, key: ec.EllipticCurvePublicKey | None, *, now_ms: int
    ) -> str | None:
        """None when `record` is its owner's, signed with `key`, and not from the future;
        else why it is refused (counted)."""
        why = self._check(record, key, now_ms)
        if why is not None:
            self.refused += 1
        return why

    def _check(
        self, record: NodeRecord, key: ec.EllipticCurvePublicKey | None, now_ms: int
    ) -> str | None:
        if key is None:
            return f"a record for {record.nodeId}, whose key this node does not hold"
        if record.generation > now_ms + MAX_SKEW_MS:
            return f"a record for {record.nodeId} from the future (generation {record.generation})"
        if not record.signature:
            return f"an unsigned record for {record.nodeId}"
        payload = signed_bytes(record)
        point = key.public_bytes(_DER, _SPKI)
        digest = hashlib.sha256(
            payload + b"\0" + point + b"\0" + record.signature.encode()
        ).digest()
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return None
        try:
            signature = base64.urlsafe_b64decode(record.signature.encode("ascii"))
            key.verify(signature, payload, _ALGORITHM)
        except (ValueError, InvalidSignature):
            return f"a record for {record.nodeId} that {record.nodeId} did not sign"
        self._verified[digest] = None
        if len(self._verified) > CACHE:
            self._verified.popitem(last=False)
        return None
