"""What every route group of the plane's API is handed (`plane.http.mounts`): the database
pool its handlers query and who is calling. `PlaneServer` builds one `ApiContext` over its
store and passes it to each mount; a route group needs nothing else of the server.

It imports none of the route groups, so each of them may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from plane.core.roles import Role
from plane.db.connection import Pool
from plane.db.store import PlaneStore
from plane.http.answers import refusal

__all__ = ["ApiContext"]


@dataclass(frozen=True)
class ApiContext:
    """The store the plane's routes read and write (`pool` for their own queries), and who is
    calling (`caller`, `admin`), as the route groups see them."""

    store: PlaneStore

    @property
    def pool(self) -> Pool:
        """The connection pool a handler takes its connection from."""
        return self.store.pool

    async def caller(self, request: web.Request) -> tuple[Role, str | None]:
        """(Role.ADMIN, None), (Role.CLUSTER, clu_ id) or (Role.TENANT, ten_ id); raises 401
        otherwise."""
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.startswith("Bearer ") else ""
        # Tokens are printable text; a header of raw bytes that are not UTF-8 (kept as lone
        # surrogates) or control characters is no token at all, not a 500 when hashed.
        if token and token.isprintable():
            cluster = await self.store.cluster_for(token)
            if cluster is not None:
                return Role.CLUSTER, cluster
            tenant = await self.store.tenant_for(token)
            if tenant is not None:
                return Role.TENANT, tenant
            if await self.store.is_admin(token):
                return Role.ADMIN, None
        raise refusal(401, "a valid admin, cluster or tenant token is required", spaced=True)

    async def admin(self, request: web.Request) -> None:
        """Raise 401 / 403 unless the admin token is the caller."""
        role, _ = await self.caller(request)
        if role is not Role.ADMIN:
            raise refusal(403, "this call needs the admin token", spaced=True)
