"""Cluster enrolment tokens: `hgro1.` + a random secret, shown once, stored as a hash.

A token names its cluster (`hgro1.<cluster id>.<secret>`) so the plane finds the row to
check without trying every hash; the stored value is the SHA-256 of the whole token, so a
database dump does not let anyone sync as a cluster.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

from plane.core.ids import is_id

__all__ = ["TOKEN_PREFIX", "hash_token", "mint_token", "token_cluster", "token_matches"]

TOKEN_PREFIX: Final = "hgro1."


def mint_token(cluster_id: str) -> str:
    """A new enrolment token for `cluster_id`; only its hash is stored."""
    return f"{TOKEN_PREFIX}{cluster_id}.{secrets.token_urlsafe(32)}"


def hash_token(token: str) -> str:
    """What the plane stores."""
    return hashlib.sha256(token.encode()).hexdigest()


def token_cluster(token: str) -> str | None:
    """The cluster id a well-formed token names, or None."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    cluster_id, _, secret = token[len(TOKEN_PREFIX) :].partition(".")
    return cluster_id if is_id(cluster_id, "clu") and len(secret) >= 32 else None


def token_matches(token: str, stored_hash: str) -> bool:
    """Constant-time comparison against the stored hash."""
    return hmac.compare_digest(hash_token(token), stored_hash)
