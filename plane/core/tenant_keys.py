"""Tenant API keys: `nvt1.` + a random secret, shown once, stored as its SHA-256.

A tenant key authenticates plane API calls as that tenant, which sees and changes only its
own objects. The stored hash is the row's key, so a lookup is one indexed read; the secret is
256 random bits, so the hash says nothing about it and a database dump lets no one in.
"""

from __future__ import annotations

import secrets
from typing import Final

from plane.core.tokens import hash_token
from plane.db.connection import Conn

__all__ = ["TENANT_KEY_PREFIX", "mint_tenant_key", "tenant_for"]

TENANT_KEY_PREFIX: Final = "nvt1."


def mint_tenant_key() -> str:
    """A new tenant key; only `hash_token(key)` is stored."""
    return TENANT_KEY_PREFIX + secrets.token_urlsafe(32)


async def tenant_for(conn: Conn, key: str) -> str | None:
    """The tenant an unrevoked key belongs to, or None."""
    if not key.startswith(TENANT_KEY_PREFIX):
        return None
    cursor = await conn.execute(
        "SELECT tenant_id FROM tenant_keys WHERE hash = %s AND revoked_at IS NULL",
        (hash_token(key),),
    )
    row = await cursor.fetchone()
    return None if row is None else str(row[0])
