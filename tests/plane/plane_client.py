"""Calling a plane over HTTP in tests: the admin token, a client, enrolment, and the node
certificates a sync is signed with (`plane.fleet.node_signing`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from certs import Identity
from certs.identity import describe, issue_node_cert, make_ca, new_key
from certs.ids import is_node_id, new_node_id
from plane.db.store import PlaneStore
from plane.fleet.node_signing import sign_sync

ADMIN = "nvpadm1.test-admin-token"


class ClusterCa:
    """A cluster CA minted for a test, issuing node identities on demand (one per node id,
    kept: a node signs every batch with the same certificate)."""

    def __init__(self, name: str = "test") -> None:
        self.key, self.cert = make_ca(name)
        self._nodes: dict[str, Identity] = {}

    def node(self, node_id: str | None = None, *, now: datetime.datetime | None = None) -> Identity:
        """The identity of `node_id` (a fresh node without one); `now` issues a new one as
        of that instant (an expired certificate, say) instead of the kept one."""
        node_id = node_id or new_node_id()
        if now is None and node_id in self._nodes:
            return self._nodes[node_id]
        key = new_key()
        cert = issue_node_cert(
            ca_key=self.key,
            ca_cert=self.cert,
            public_key=key.public_key(),
            node_id=node_id,
            name=node_id[-6:],
            now=now,
        )
        identity = Identity(key=key, cert=cert, ca=self.cert, node=describe(cert))
        if now is None:
            self._nodes[node_id] = identity
        return identity

    def headers(self, body: bytes, node_id: str | None = None) -> dict[str, str]:
        """The signature headers of `body` as the node it names (`nodeId`), or `node_id`."""
        identity = self.node(node_id or _named_node(body))
        return signed(body, identity)


def signed(body: bytes, identity: Identity) -> dict[str, str]:
    """`body`'s signature headers as `identity`."""
    return sign_sync(body, key=identity.key, cert=identity.cert, ca=identity.ca)


def _named_node(body: bytes) -> str | None:
    """The `nodeId` a sync body names, when it is JSON with a well-formed one."""
    try:
        named = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    node_id = named.get("nodeId") if isinstance(named, dict) else None
    return node_id if isinstance(node_id, str) and is_node_id(node_id) else None


@dataclass
class Plane:
    """A plane server under test: its URL and the store behind it. Each cluster token's
    syncs are signed by a node of that cluster's own `ClusterCa` (`cas`), the node the
    batch names, unless the call says `sign=False`."""

    url: str
    store: PlaneStore
    cas: dict[str, ClusterCa] = field(default_factory=dict)

    def ca(self, token: str) -> ClusterCa:
        """The CA of the cluster whose token is `token`."""
        return self.cas.setdefault(token, ClusterCa())

    async def call(
        self, method: str, path: str, token: str, body: Any = None, **kw: Any
    ) -> tuple[int, Any]:
        """(status, decoded JSON body) of one call with `token`; `sign=False` sends a sync
        with only the headers given."""
        sign = bool(kw.pop("sign", True))
        headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
        data = body if isinstance(body, bytes) else None
        if sign and method == "POST" and path == "/v1/sync":
            data = data if data is not None else msgspec.json.encode(body)
            headers = {
                "Content-Type": "application/json",
                **self.ca(token).headers(data),
                **headers,
            }
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                self.url + path,
                headers=headers,
                data=data,
                json=body if data is None else None,
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
