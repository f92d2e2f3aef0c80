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
from agent.artifacts.fetches import Fetches, FetchRefused
from agent.artifacts.store import StoreError, describe_files
from agent.artifacts.weights import where
from agent.cluster.artifacts import ArtifactRefused, Artifacts
from facts.artifacts import MAX_PIECE_SIZE, PIECE_SIZE, Artifact, manifest_digest
from facts.records import NodeRecord

__all__ = ["AddArtifact", "artifact_routes"]


class AddArtifact(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of `POST /v1/artifacts` (`nvpair artifact add`)."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]  # on this member
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    pieceSize: Annotated[int, Meta(ge=64 * 1024, le=MAX_PIECE_SIZE)] = PIECE_SIZE


_add = msgspec.json.Decoder(AddArtifact)


class _Warm(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    warm: bool = True


_warm = msgspec.json.Decoder(_Warm)


def artifact_routes(
    artifacts: Artifacts, fetches: Fetches, records: Callable[[], list[NodeRecord]] = list
) -> list[web.RouteDef]:
    """The routes over this member's artifact facts and fetches; `records`, the members'
    records, say what each member holds."""
    store = fetches.store

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
        if not wanted.path.startswith("/"):
            raise bad_request("an absolute path on this member", "path")
        source = Path(wanted.path)
        try:
            manifest = await asyncio.to_thread(describe_files, source, wanted.pieceSize)
            digest = manifest_digest(manifest)
            if await asyncio.to_thread(store.resident, digest) is not None:
                await asyncio.to_thread(store.touch, digest)  # the same files again: a use
            else:
                await asyncio.to_thread(fetches.make_room, manifest.size)
                raw = msgspec.json.encode(manifest)
                await asyncio.to_thread(store.put_manifest, digest, raw)
                await asyncio.to_thread(store.import_files, source, digest)
            made = artifacts.add(wanted.name, manifest)
        except (StoreError, ArtifactRefused) as exc:
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
