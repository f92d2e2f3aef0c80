"""Invite tokens and the join protocol, as pure functions over a cluster dir.

`nvpair cluster invite` makes a one-time, expiring token `nvp1.<base64url>` that carries the
CA fingerprint, an invite id, a 32-byte secret and the expiry. The admitter stores only the
SHA-256 of the secret. Joining:

1. the joiner makes a key and a CSR (`prepare_join`) and sends the request, secret included,
   to the admitter over TLS whose server certificate it checks against the token's CA
   fingerprint (`check_admitter`);
2. the admitter checks cluster, secret, expiry and single use, signs a certificate with a
   node id it mints itself, pins the new member, and answers with the certificate, `ca.crt`
   and the member pins (`admit`);
3. the joiner checks the answer against the token and its own key and installs the identity
   (`complete_join`).

The node API (a later issue) only carries the bytes.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import os
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from msgspec import Meta
from ulid import ULID

from certs._files import ensure_private_dir, write_atomic
from certs.cluster_dir import ClusterDir
from certs.errors import BadInviteLifetime, BadJoinResponse, InviteRefused
from certs.identity import (
    PrivateKey,
    ca_fingerprint,
    cert_pem,
    describe,
    issue_node_cert,
    load_cert,
    make_csr,
    new_key,
    operator_sans,
    verify_issued_by,
)
from certs.ids import new_node_id

__all__ = [
    "DEFAULT_TTL",
    "Invite",
    "JoinRequest",
    "JoinResponse",
    "Tombstone",
    "admit",
    "check_admitter",
    "complete_join",
    "create_invite",
    "parse_token",
    "prepare_join",
    "tombstones",
]

TOKEN_PREFIX: Final = "nvp1."
DEFAULT_TTL: Final = datetime.timedelta(minutes=15)
MAX_TTL: Final = datetime.timedelta(days=7)
_LAYOUT: Final = struct.Struct(">32s16s32sQ")  # CA fingerprint, invite id, secret, expiry (s)

_Pem = Annotated[str, Meta(min_length=1, max_length=16_384)]


@dataclass(frozen=True, slots=True)
class Invite:
    """What a token carries."""

    ca_fingerprint: bytes
    invite_id: str
    secret: bytes
    expires_at: int  # epoch seconds

    def token(self) -> str:
        """The printable one-time token."""
        packed = _LAYOUT.pack(
            self.ca_fingerprint, ULID.from_str(self.invite_id).bytes, self.secret, self.expires_at
        )
        return TOKEN_PREFIX + base64.urlsafe_b64encode(packed).rstrip(b"=").decode()


class JoinRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Joiner → admitter."""

    caFingerprint: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
    inviteId: Annotated[str, Meta(min_length=26, max_length=26)]
    secret: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
    csr: _Pem


class Tombstone(msgspec.Struct, kw_only=True, frozen=True):
    """A removed member, as the admitter knows it: written by a joiner before it pins
    anything, so a stale member's push cannot bring the removed one back through it."""

    nodeId: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^nod_[0-9a-z]+$")]
    name: Annotated[str, Meta(max_length=256)] = ""
    pin: Annotated[str, Meta(max_length=64, pattern=r"^[0-9a-f]*$")] = ""
    removedAt: Annotated[float, Meta(ge=0)] = 0.0
    statement: Annotated[str, Meta(max_length=16384)] = ""  # the remover's signed removal


class JoinResponse(msgspec.Struct, kw_only=True, frozen=True):
    """Admitter → joiner: the new certificate, the CA, every member's certificate and every
    removed member's tombstone."""

    cert: _Pem
    ca: _Pem
    pins: Annotated[list[_Pem], Meta(max_length=1024)]
    removed: Annotated[list[Tombstone], Meta(max_length=4096)] = []


def create_invite(
    cluster: ClusterDir,
    *,
    ttl: datetime.timedelta = DEFAULT_TTL,
    now: float | None = None,
) -> Invite:
    """Mint a one-time invite on a CA holder and store the hash of its secret."""
    if not datetime.timedelta(seconds=1) <= ttl <= MAX_TTL:
        raise BadInviteLifetime(f"invite lifetime must be between 1 second and {MAX_TTL.days} days")
    _, ca_cert = cluster.load_ca()
    now = time.time() if now is None else now
    invite = Invite(
        ca_fingerprint=ca_fingerprint(ca_cert),
        invite_id=str(ULID()),
        secret=secrets.token_bytes(32),
        expires_at=int(now + ttl.total_seconds()),
    )
    ensure_private_dir(cluster.invites)
    record = {
        "secretSha256": hashlib.sha256(invite.secret).hexdigest(),
        "expiresAt": invite.expires_at,
        "createdAt": now,
    }
    write_atomic(
        cluster.invites / f"{invite.invite_id}.json", json.dumps(record).encode(), mode=0o600
    )
    _forget_expired(cluster, now)
    return invite


def parse_token(token: str) -> Invite:
    """Read a token; a malformed one is refused with a clear error."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise InviteRefused(f"not an nvpair invite (it must start with {TOKEN_PREFIX!r})")
    body = token[len(TOKEN_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        fingerprint, invite_id, secret, expires = _LAYOUT.unpack(raw)
    except (ValueError, struct.error):
        raise InviteRefused("malformed invite token (truncated or mistyped?)") from None
    return Invite(fingerprint, str(ULID.from_bytes(invite_id)), secret, expires)


def prepare_join(
    token: str, name: str, sans: list[str] | None = None
) -> tuple[JoinRequest, PrivateKey]:
    """Joiner: a fresh key and the request that proves the invite's secret."""
    invite = parse_token(token)
    key = new_key()
    csr = make_csr(key, name, sans or [])
    request = JoinRequest(
        caFingerprint=invite.ca_fingerprint.hex(),
        inviteId=invite.invite_id,
        secret=invite.secret.hex(),
        name=name,
        csr=csr.public_bytes(serialization.Encoding.PEM).decode(),
    )
    return request, key


def admit(cluster: ClusterDir, request: JoinRequest, *, now: float | None = None) -> JoinResponse:
    """Admitter: check the invite, sign the new member, pin it, answer with the pins.

    Checks run in a fixed order -- cluster, invite, secret, expiry, single use -- and each
    refusal says which one failed. The invite is used up only once everything else passed.
    """
    now = time.time() if now is None else now
    ca_key, ca_cert = cluster.load_ca()
    ours = ca_fingerprint(ca_cert).hex()
    if not hmac.compare_digest(request.caFingerprint, ours):
        raise InviteRefused(
            f"invite is for another cluster (CA {request.caFingerprint[:16]}…, "
            f"this cluster's CA is {ours[:16]}…)"
        )
    record_path = cluster.invites / f"{_safe_id(request.inviteId)}.json"
    try:
        record = json.loads(record_path.read_bytes())
    except (FileNotFoundError, ValueError):
        raise InviteRefused("invite not recognised: forged, mistyped or made elsewhere") from None
    presented = hashlib.sha256(bytes.fromhex(request.secret)).hexdigest()
    if not hmac.compare_digest(presented, str(record.get("secretSha256", ""))):
        raise InviteRefused("invite secret does not match: the token is forged or damaged")
    expires = int(record["expiresAt"])
    if now > expires:
        raise InviteRefused(f"invite expired at {_iso(expires)}; ask for a new one")
    csr = _check_csr(request.csr)
    public_key = csr.public_key()
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    _use_once(cluster, request.inviteId, now)
    cert = issue_node_cert(
        ca_key=ca_key,
        ca_cert=ca_cert,
        public_key=public_key,
        node_id=new_node_id(),
        name=request.name,
        sans=operator_sans(csr.extensions)[:64],  # the node id's names are ours to add
    )
    cluster.pins.pin(cert, ca=ca_cert)
    return JoinResponse(
        cert=cert_pem(cert).decode(),
        ca=cert_pem(ca_cert).decode(),
        pins=[pem.decode() for pem in cluster.pins.pems()],
        removed=tombstones(cluster),
    )


def tombstones(cluster: ClusterDir) -> list[Tombstone]:
    """Every removed member this node knows of."""
    return [
        Tombstone(
            nodeId=m.node_id,
            name=m.name,
            pin=m.pin,
            removedAt=m.removed.timestamp(),
            statement=m.statement,
        )
        for m in cluster.pins.members()
        if m.removed is not None
    ]


def check_admitter(token: str, ca_pem: bytes, server_cert_der: bytes) -> None:
    """Joiner: the server we talk to holds a certificate of the CA the token names."""
    invite = parse_token(token)
    ca = load_cert(ca_pem)
    if ca_fingerprint(ca) != invite.ca_fingerprint:
        raise BadJoinResponse("the admitter's CA is not the one the invite names")
    if not verify_issued_by(x509.load_der_x509_certificate(server_cert_der), ca):
        raise BadJoinResponse("the admitter's certificate is not signed by the invite's CA")


def complete_join(cluster: ClusterDir, token: str, key: PrivateKey, response: JoinResponse) -> str:
    """Joiner: check the answer and install the identity; returns the new node id."""
    invite = parse_token(token)
    try:
        ca = load_cert(response.ca.encode())
        cert = load_cert(response.cert.encode())
        pins = [load_cert(pem.encode()) for pem in response.pins]
    except ValueError as exc:
        raise BadJoinResponse(f"unreadable certificate in the answer ({exc})") from None
    if ca_fingerprint(ca) != invite.ca_fingerprint:
        raise BadJoinResponse("the answer's CA is not the one the invite names")
    if not verify_issued_by(cert, ca):
        raise BadJoinResponse("the new certificate is not signed by the cluster CA")
    if cert.public_key() != key.public_key():
        raise BadJoinResponse("the new certificate is not for our key")
    node_id = describe(cert).node_id
    # The removals first: nothing pinned from here on can bring a removed member back.
    for tomb in response.removed:
        if tomb.nodeId != node_id:
            cluster.pins.tombstone(
                tomb.nodeId,
                name=tomb.name,
                pin=tomb.pin,
                at=tomb.removedAt,
                statement=tomb.statement,
            )
    removed = {t.nodeId for t in response.removed}
    pins = [c for c in pins if describe(c).node_id not in removed]
    cluster.write_identity(key, cert, ca, pins=[cert, *pins])
    return node_id


# -- helpers ------------------------------------------------------------------------------


def _check_csr(pem: str) -> x509.CertificateSigningRequest:
    try:
        csr = x509.load_pem_x509_csr(pem.encode())
    except ValueError:
        raise InviteRefused("the certificate request is not a PEM CSR") from None
    if not csr.is_signature_valid:
        raise InviteRefused("the certificate request's signature is invalid")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise InviteRefused("the certificate request must be for an EC P-256 key")
    return csr


def _use_once(cluster: ClusterDir, invite_id: str, now: float) -> None:
    marker = cluster.invites / f"{_safe_id(invite_id)}.used"
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        used = marker.stat().st_mtime
        raise InviteRefused(f"invite already used at {_iso(used)}; ask for a new one") from None
    with os.fdopen(fd, "w") as out:
        out.write(str(now))


def _safe_id(invite_id: str) -> str:
    # Only a ULID may name a file: never a path from the network.
    try:
        return str(ULID.from_str(invite_id))
    except ValueError:
        raise InviteRefused("invite not recognised: forged, mistyped or made elsewhere") from None


def _forget_expired(cluster: ClusterDir, now: float) -> None:
    # Expired invites are deleted a day after expiry; their .used markers go with them.
    for path in cluster.invites.glob("*.json"):
        try:
            expires = int(json.loads(path.read_bytes())["expiresAt"])
        except (ValueError, KeyError, OSError):
            continue
        if now > expires + 86_400:
            path.unlink(missing_ok=True)
            path.with_suffix(".used").unlink(missing_ok=True)


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="seconds")
