"""The local API's artifacts (issue 28): `GET /v1/artifacts` (the cluster's artifacts and
whether each is resident here), `POST /v1/artifacts` (name local files as an artifact:
hashed, taken into this member's store, announced to every member), `POST
/v1/artifacts/{name}/fetch` (fetch it from the members that hold it, in the background) and
`POST /v1/artifacts/{name}/warm` (`{"warm": bool}`: in or out of the cluster's warm set,
which every member keeps resident), `DELETE /v1/artifacts/{name}` (forget it
cluster-wide), `DELETE /v1/artifacts/{name}/here` (drop this member's copy). Owner-only,
as the whole local API."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from agent.apis.answers import bad_request, json_answer, read_json
from agent.artifacts.fetches import FetchRefused
from agent.artifacts.sources import SourceError
from agent.artifacts.weights import StoreWeights, where
from agent.cluster.artifacts import ArtifactRefused
from facts.artifacts import MAX_PIECE_SIZE, PIECE_SIZE, Artifact
from facts.records import NodeRecord

__all__ = ["AddArtifact", "artifact_routes"]


class AddArtifact(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of `POST /v1/artifacts` (`nvpair artifact add`): files on this member (`path`,
    absolute) or one file behind an https URL (`url`, with its `sha256`)."""

    path: Annotated[str, Meta(max_length=4096)] = ""
    url: Annotated[str, Meta(max_length=8192)] = ""
    sha256: Annotated[str, Meta(pattern=r"^([0-9a-f]{64})?$")] = ""
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    pieceSize: Annotated[int, Meta(ge=64 * 1024, le=MAX_PIECE_SIZE)] = PIECE_SIZE


_add = msgspec.json.Decoder(AddArtifact)


class _Warm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    warm: bool = True


_warm = msgspec.json.Decoder(_Warm)


def artifact_routes(
    weights: StoreWeights, records: Callable[[], list[NodeRecord]] = list
) -> list[web.RouteDef]:
    """The routes over this member's artifact facts, fetches and sources; `records`, the
    members' records, say what each member holds."""
    artifacts, fetches, sources = weights.artifacts, weights.fetches, weights.sources

    def view(artifact: Artifact) -> dict[str, Any]:
        shown: dict[str, Any] = msgspec.to_builtins(artifact)
        for hidden in ("byCert", "signature", "deleted"):
            shown.pop(hidden, None)
        members = where(artifact.digest, records())
        return shown | fetches.state(artifact.digest) | {"members": members}

    async def listing(request: web.Request) -> web.Response:
        return json_answer([view(a) for a in artifacts.live()])

    async def add(request: web.Request) -> web.Response:
        wanted = await read_json(request, _add)
        if bool(wanted.path) == bool(wanted.url):
            raise bad_request("a path on this member or an https:// URL, one of them", "path")
        try:
            if wanted.path:
                if not wanted.path.startswith("/"):
                    raise bad_request("an absolute path on this member", "path")
                made = await sources.take_local(
                    Path(wanted.path), wanted.name, piece_size=wanted.pieceSize
                )
            else:
                if not wanted.sha256:
                    raise bad_request("the SHA-256 of the URL's file (64 hex digits)", "sha256")
                made = await sources.take_url(
                    wanted.url, wanted.name, sha256=wanted.sha256, piece_size=wanted.pieceSize
                )
        except SourceError as exc:
            raise bad_request(exc) from None
        except FetchRefused as exc:  # no room within the disk budget
            raise web.HTTPInsufficientStorage(text=f"{exc}\n") from None
        return json_answer(view(made), status=201)

    def named(request: web.Request) -> Artifact:
        found = artifacts.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound(text=f"no artifact named {request.match_info['name']!r}\n")
        return found

    async def fetch(request: web.Request) -> web.Response:
        artifact = named(request)
        try:
            await fetches.start(artifact.digest, artifact.size)
        except FetchRefused as exc:
            raise web.HTTPServiceUnavailable(text=f"{exc}\n") from None
        return json_answer(view(artifact), status=202)

    async def drop(request: web.Request) -> web.Response:
        artifact = named(request)
        try:
            await asyncio.to_thread(fetches.drop, artifact.digest)
        except FetchRefused as exc:
            raise web.HTTPConflict(text=f"{exc}\n") from None
        return json_answer(view(artifact))

    async def warm(request: web.Request) -> web.Response:
        wanted = await read_json(request, _warm)
        try:
            made = artifacts.warm(named(request).name, wanted.warm)
        except ArtifactRefused as exc:
            raise bad_request(exc) from None
        return json_answer(view(made))

    async def forget(request: web.Request) -> web.Response:
        made = artifacts.forget(named(request).name)
        return json_answer({"forgotten": made.name, "version": made.version})

    return [
        web.get("/v1/artifacts", listing),
        web.post("/v1/artifacts", add),
        web.post("/v1/artifacts/{name}/fetch", fetch),
        web.post("/v1/artifacts/{name}/warm", warm),
        web.delete("/v1/artifacts/{name}", forget),
        web.delete("/v1/artifacts/{name}/here", drop),
    ]
