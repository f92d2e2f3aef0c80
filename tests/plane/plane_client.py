"""Calling a plane over HTTP in tests: the admin token, a client, enrolment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from plane.store import PlaneStore

ADMIN = "nvpadm1.test-admin-token"


@dataclass
class Plane:
    """A plane server under test: its URL and the store behind it."""

    url: str
    store: PlaneStore

    async def call(
        self, method: str, path: str, token: str, body: Any = None, **kw: Any
    ) -> tuple[int, Any]:
        """(status, decoded JSON body) of one call with `token`."""
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                self.url + path,
                headers=headers,
                data=body if isinstance(body, bytes) else None,
                json=body if not isinstance(body, bytes) else None,
                **kw,
            ) as response,
        ):
            text = await response.read()
            return response.status, msgspec.json.decode(text) if text else None


async def enrol(plane: Plane, name: str) -> tuple[str, str]:
    """Enrol `name` as the admin; its (cluster id, token)."""
    status, body = await plane.call("POST", "/v1/clusters", ADMIN, {"name": name})
    assert status == 201
    return body["id"], body["token"]
