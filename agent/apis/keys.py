"""The local API's key routes (behind its owner token, like every other route):

- `GET /v1/keys` -- every key the cluster holds, revoked ones included: name, models,
  limits, expiry, state (`active`, `expired`, `revoked`) and a short fingerprint of the
  secret's hash -- never the secret, never the hash.
- `POST /v1/keys` -- issue one (`KeyRequest`); 201 with the key and its `secret`, the only
  time the secret is shown. A name in use is a 409.
- `POST /v1/keys/{name}/revoke` -- revoke it on every member.

The static keys of `nvpair.toml` are this node's configuration, not listed here.
"""

from __future__ import annotations

import time
from typing import Any, Final

import msgspec
from aiohttp import web

from agent.apis.answers import json_answer, read_json
from agent.cluster.api_keys import ApiKeys, KeyExists, KeyRefused, KeyRequest
from facts.api_keys import ApiKey, fingerprint

__all__ = ["key_routes", "key_view"]

_request: Final = msgspec.json.Decoder(KeyRequest)


def key_view(key: ApiKey, now_ms: int) -> dict[str, Any]:
    """A key as people read it: no hash, no signature."""
    state = "revoked" if key.revoked else "expired" if key.expired(now_ms) else "active"
    return {
        "name": key.name,
        "models": key.models,
        "rpm": key.rpm,
        "tpm": key.tpm,
        "expiresAt": key.expiresAt,
        "createdAt": key.createdAt,
        "state": state,
        "fingerprint": fingerprint(key.keyHash),
        "version": key.version,
        "updatedAt": key.updatedAt,
        "by": key.by,
    }


def key_routes(keys: ApiKeys | None) -> list[web.RouteDef]:
    """The routes over this node's copy of the keys (none without it)."""
    if keys is None:
        return []

    async def listing(request: web.Request) -> web.Response:
        now_ms = int(time.time() * 1000)
        return json_answer([key_view(k, now_ms) for k in keys.all()])

    async def create(request: web.Request) -> web.Response:
        wanted = await read_json(request, _request)
        try:
            made, secret = keys.create(wanted)
        except KeyRefused as exc:
            refusal = web.HTTPConflict if isinstance(exc, KeyExists) else web.HTTPBadRequest
            raise refusal(text=f"{str(exc)[:500]}\n") from None
        return json_answer(
            {**key_view(made, int(time.time() * 1000)), "secret": secret}, status=201
        )

    async def revoke(request: web.Request) -> web.Response:
        try:
            made = keys.revoke(request.match_info["name"])
        except KeyRefused as exc:
            raise web.HTTPNotFound(text=f"{str(exc)[:500]}\n") from None
        return json_answer({"revoked": made.name, "version": made.version})

    return [
        web.get("/v1/keys", listing),
        web.post("/v1/keys", create),
        web.post("/v1/keys/{name}/revoke", revoke),
    ]
