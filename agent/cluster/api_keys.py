"""This node's copy of the cluster's API keys: issued here or learnt from members, kept in
`$NVPAIR_HOME/api-keys.json` (0600), pushed with every records push.

Creating and revoking sign a new version with this node's key (`agent.cluster.signed_facts` says how
they are kept, `facts.signed_set` how versions converge). Only the SHA-256 of a secret is
kept, here and in every push; the secret is returned once, to whoever created the key. A
file that cannot be read is set aside as `api-keys.json.corrupt` and the node starts
*closed*: it holds no key, but it knows keys existed, so its facade lets nobody in until a
member pushes the keys again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Final

import msgspec
from cryptography import x509
from msgspec import Meta

from agent.cluster.signed_facts import FactRefused, SignedFacts
from certs import Identity, write_atomic
from facts.api_keys import ApiKey, KeySet, hash_secret, new_secret
from facts.record_signing import RecordVerifier, sign_statement

__all__ = ["KEYS_FILE", "ApiKeys", "KeyExists", "KeyRefused", "KeyRequest", "save_joined"]

KEYS_FILE: Final = "api-keys.json"
MAX_EXPIRY_S: Final = 100 * 365 * 24 * 3600
_encode: Final = msgspec.json.Encoder().encode
_decode_key: Final = msgspec.json.Decoder(ApiKey).decode


def save_joined(home: Path, keys: Iterable[msgspec.Raw], ca: x509.Certificate) -> None:
    """Keep the keys a join answer carried (as signed), each checked against the cluster
    CA, so a node that joins a cluster with keys starts with its facade closed to anyone
    without one (and listening on every interface) instead of open until its first push."""
    verifier = RecordVerifier()
    held = []
    for raw in keys:
        try:
            key = _decode_key(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if verifier.statement_why_not(key, ca, f"an API key {key.name}", raw=bytes(raw)) is None:
            held.append(raw)
    if held:
        write_atomic(home / KEYS_FILE, _encode(held))


class KeyRefused(FactRefused):
    """A key request that cannot be taken (no such key, a name in use, bad limits)."""


class KeyExists(KeyRefused):
    """A key of that name is in use."""


class KeyRequest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of `POST /v1/keys` (`nvpair keys create`): a key, less what the cluster adds."""

    name: str
    models: list[str] = []
    rpm: int = 0
    tpm: int = 0
    expiresInS: Annotated[int, Meta(ge=0, le=MAX_EXPIRY_S)] = 0  # 0 never


class ApiKeys(SignedFacts[ApiKey]):
    """API keys, persisted (`SignedFacts`); creating and revoking make signed versions."""

    file = KEYS_FILE
    refused = KeyRefused
    lost_means = "the facade lets nobody in until a member pushes the keys"

    def new_set(self) -> KeySet:
        """An empty set of keys."""
        return KeySet()

    @classmethod
    def signed_by(cls, identity: Identity, home: Path, on_change: Callable[[], None]) -> ApiKeys:
        """The keys of `home`, whose new versions `identity` (this node's) signs."""
        return cls(
            home,
            sign=lambda k: sign_statement(k, identity.key, identity.cert),
            on_change=on_change,
        )

    def in_use(self) -> bool:
        """Whether this cluster uses keys: any key held, revoked or expired included (the
        facade stays closed once a key was ever issued), or a keys file that was unreadable."""
        return self.lost or len(self.held) > 0

    def create(self, request: KeyRequest) -> tuple[ApiKey, str]:
        """Issue a key; the version made here and its secret (shown once, never kept)."""
        held = self.held.get(request.name)
        if held is not None and not held.revoked:
            raise KeyExists(f"a key named {request.name!r} exists; revoke it first")
        now_ms = self._now_ms()
        secret = new_secret()
        expires = now_ms + request.expiresInS * 1000 if request.expiresInS else 0
        try:
            fresh = ApiKey(
                name=request.name,
                keyHash=hash_secret(secret),
                models=sorted(set(request.models)),
                rpm=request.rpm,
                tpm=request.tpm,
                expiresAt=expires,
                createdAt=now_ms,
            )
            fresh = msgspec.convert(msgspec.to_builtins(fresh), ApiKey)  # the wire's checks
        except msgspec.ValidationError as exc:
            raise KeyRefused(f"bad key: {exc}") from None
        return self.commit(fresh), secret

    def revoke(self, name: str) -> ApiKey:
        """Revoke a key everywhere: a tombstone version, without its hash."""
        held = self.held.get(name)
        if held is None or held.revoked:
            raise KeyRefused(f"no key named {name!r}")
        return self.commit(msgspec.structs.replace(held, keyHash="", revoked=True))
