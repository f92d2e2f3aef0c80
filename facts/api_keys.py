"""API keys: cluster facts, signed by the member that issued them. Sans-I/O.

An `ApiKey` says who may use the facade: its name (the jobs' `requesterId`), the SHA-256 of
its secret (never the secret: `nvpair keys create` shows that once), the models it may ask
for (none listed: all), its requests and tokens per minute (0: no limit) and when it
expires. Any member may issue or revoke one, as any member may declare a deployment or
remove a member: the operator of any machine owns the cluster. Each version is a statement
signed by the member that made it (`facts.record_signing.sign_statement`), so members check
it against the cluster CA alone, whoever relays it.

**Convergence** is that of every signed cluster fact (`facts.signed_set`): keyed by name, a
member takes a version that is higher in `(version, updatedAt, by)` order than the one it
holds. A revocation is a version with `revoked` set and no hash (a tombstone). Tombstones are
not forgotten by age -- a late copy of a key's older version must never bring a revoked key
back -- but only when room is needed: first records that have expired (a late copy of those
admits nothing), then the oldest tombstone.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Annotated, Final

from msgspec import Meta, Struct

from facts.signed_set import FactKind, SignedSet

__all__ = [
    "API_KEY",
    "MAX_KEYS",
    "SECRET_PREFIX",
    "ApiKey",
    "KeySet",
    "fingerprint",
    "hash_secret",
    "hashes_match",
    "new_secret",
]

MAX_KEYS: Final = 1024  # held at once in one cluster, tombstones included
SECRET_PREFIX: Final = "sk-nvp-"

_Name = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")]
_Model = Annotated[str, Meta(min_length=1, max_length=256)]
_Hash = Annotated[str, Meta(pattern=r"^([0-9a-f]{64})?$")]
_Count = Annotated[int, Meta(ge=0, le=2**53 - 1)]


class ApiKey(Struct, kw_only=True, frozen=True):
    """One version of an API key (a signed statement). Fields of a later release are kept
    with it as signed (`facts.kept`), not refused."""

    name: _Name
    keyHash: _Hash = ""  # sha256 hex of the secret; "" once revoked
    models: Annotated[list[_Model], Meta(max_length=256)] = []  # [] every model
    rpm: _Count = 0  # requests per minute across the cluster; 0 no limit
    tpm: _Count = 0  # tokens per minute across the cluster; 0 no limit
    expiresAt: _Count = 0  # epoch ms; 0 never
    createdAt: _Count = 0  # epoch ms
    revoked: bool = False
    version: Annotated[int, Meta(ge=1, le=2**53 - 1)] = 1
    updatedAt: _Count = 0  # epoch ms
    by: Annotated[str, Meta(max_length=256)] = ""  # the member that made this version
    byCert: Annotated[str, Meta(max_length=8192)] = ""
    signature: Annotated[str, Meta(max_length=256)] = ""

    def expired(self, now_ms: int) -> bool:
        """Whether the key's expiry has passed."""
        return 0 < self.expiresAt <= now_ms

    def usable(self, now_ms: int) -> bool:
        """Whether a request with this key's secret is let in (limits aside)."""
        return not self.revoked and bool(self.keyHash) and not self.expired(now_ms)

    def allows(self, model: str) -> bool:
        """Whether the key may ask for `model`."""
        return not self.models or model in self.models


def new_secret() -> str:
    """A fresh secret: `sk-nvp-` and 256 random bits."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    """What the cluster keeps of a secret: its SHA-256, hex. A secret is 256 random bits,
    so an unsalted hash is as hard to reverse as the secret is to guess."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def hashes_match(held: str, presented: str) -> bool:
    """Constant-time comparison of two hashes."""
    return hmac.compare_digest(held.encode("ascii"), presented.encode("ascii"))


def fingerprint(key_hash: str) -> str:
    """A short name for a key's secret that people can compare (never more of the hash)."""
    return key_hash[:8]


API_KEY: Final[FactKind[ApiKey]] = FactKind(
    what="API key",
    struct=ApiKey,
    key=lambda k: k.name,
    is_tombstone=lambda k: k.revoked,
    says=lambda k: "revoked" if k.revoked else "issued",
    capacity=MAX_KEYS,
    expires_at=lambda k: k.expiresAt,
    tombstone_ms=None,  # a revoked key is never forgotten by age, only when room is needed
)


class KeySet(SignedSet[ApiKey]):
    """The versions of API keys this member holds, one per name, at most `capacity`."""

    def __init__(self, *, capacity: int = MAX_KEYS) -> None:
        super().__init__(API_KEY, capacity=capacity)
