"""This node's copy of the cluster's API keys: issued here or learnt from members, kept in
`$NVPAIR_HOME/api-keys.json` (0600), pushed with every records push.

Creating and revoking sign a new version with this node's key (`broker.api_keys` says how
versions converge). Only the SHA-256 of a secret is kept, here and in every push; the secret
is returned once, to whoever created the key. A file that cannot be read is set aside as
`api-keys.json.corrupt` and the node starts *closed*: it holds no key, but it knows keys
existed, so its facade lets nobody in until a member pushes the keys again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Final

import msgspec
from cryptography import x509
from msgspec import Meta

from broker.api_keys import ApiKey, KeySet, hash_secret, keys_decoder, new_secret
from broker.record_signing import RecordVerifier, sign_statement
from certs import Identity, write_atomic

from .errors import AgentError

__all__ = ["KEYS_FILE", "ApiKeys", "KeyExists", "KeyRefused", "KeyRequest", "save_joined"]

log = logging.getLogger(__name__)

KEYS_FILE: Final = "api-keys.json"
MAX_EXPIRY_S: Final = 100 * 365 * 24 * 3600
_encode: Final = msgspec.json.Encoder().encode


def save_joined(home: Path, keys: Iterable[ApiKey], ca: x509.Certificate) -> None:
    """Keep the keys a join answer carried, each checked against the cluster CA, so a node
    that joins a cluster with keys starts with its facade closed to anyone without one (and
    listening on every interface) instead of open until its first push."""
    verifier = RecordVerifier()
    held = [k for k in keys if verifier.statement_why_not(k, ca, f"an API key {k.name}") is None]
    if held:
        write_atomic(home / KEYS_FILE, _encode(held))


class KeyRefused(AgentError):
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


class ApiKeys:
    """API keys, persisted; `on_change` runs when the set changes (with `changes` counted,
    so readers can tell that an index of theirs is stale)."""

    def __init__(
        self,
        home: Path,
        *,
        sign: Callable[[ApiKey], ApiKey],
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = home / KEYS_FILE
        self._sign = sign
        self._on_change = on_change
        self._clock = clock
        self.held = KeySet()
        self.closed = False  # keys existed but could not be read: let nobody in
        self.changes = 0
        for key in self._load():
            self.held.offer(key, self._now_ms())

    @classmethod
    def signed_by(cls, identity: Identity, home: Path, on_change: Callable[[], None]) -> ApiKeys:
        """The keys of `home`, whose new versions `identity` (this node's) signs."""
        return cls(
            home,
            sign=lambda k: sign_statement(k, identity.key, identity.cert),
            on_change=on_change,
        )

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _load(self) -> list[ApiKey]:
        try:
            return keys_decoder.decode(self.path.read_bytes())
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.warning("setting %s aside as %s (facade closed): %s", self.path, aside.name, exc)
            self.path.replace(aside)
            self.closed = True
            return []

    def _changed(self) -> None:
        write_atomic(self.path, _encode(self.held.all()))
        self.changes += 1
        self._on_change()

    # -- reads --------------------------------------------------------------------------------

    def all(self) -> list[ApiKey]:
        """Every version held, tombstones included (what a push carries)."""
        return self.held.all()

    def in_use(self) -> bool:
        """Whether this cluster uses keys: any key held, revoked or expired included (the
        facade stays closed once a key was ever issued), or a keys file that was unreadable."""
        return self.closed or len(self.held) > 0

    # -- changes ------------------------------------------------------------------------------

    def merge(self, offered: Iterable[ApiKey]) -> list[ApiKey]:
        """Take the newer versions a member pushed (signatures checked by the caller)."""
        now_ms = self._now_ms()
        taken = [k for k in offered if self.held.offer(k, now_ms)]
        if taken:
            self.closed = False
            for k in taken:
                state = "revoked" if k.revoked else "issued"
                log.info("API key %s %s (version %d, by %s)", k.name, state, k.version, k.by)
            self._changed()
        return taken

    def create(self, request: KeyRequest) -> tuple[ApiKey, str]:
        """Issue a key; the version made here and its secret (shown once, never kept)."""
        now_ms = self._now_ms()
        held = self.held.get(request.name)
        if held is not None and not held.revoked:
            raise KeyExists(f"a key named {request.name!r} exists; revoke it first")
        if held is None and self.held.full(now_ms):
            raise KeyRefused(f"the cluster holds {self.held.capacity} keys; revoke some first")
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
        return self._commit(fresh, now_ms), secret

    def revoke(self, name: str) -> ApiKey:
        """Revoke a key everywhere: a tombstone version, without its hash."""
        held = self.held.get(name)
        if held is None or held.revoked:
            raise KeyRefused(f"no key named {name!r}")
        tombstone = msgspec.structs.replace(held, keyHash="", revoked=True)
        return self._commit(tombstone, self._now_ms())

    def _commit(self, key: ApiKey, now_ms: int) -> ApiKey:
        held = self.held.get(key.name)
        version = msgspec.structs.replace(
            key,
            version=self.held.next_version(key.name),
            updatedAt=max(now_ms, held.updatedAt if held is not None else 0),
        )
        signed = self._sign(version)
        if not self.held.offer(signed, now_ms):  # cannot happen: the version is the next one
            raise KeyRefused(f"{key.name}: a newer version arrived meanwhile")
        self._changed()
        return signed
