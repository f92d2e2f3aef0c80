"""Artifacts from outside the members (`agent.artifacts.sources`, issue 28, item 6), against
a real HTTPS server the test starts on 127.0.0.1 with its own CA (nvpair never reaches the
internet in tests): a URL's file is taken only when its SHA-256 is the one given; plain
http, a wrong hash, an error status and an oversized answer are refused with nothing kept;
a URL's token never appears in an error; a plane warm artifact the cluster does not know is
taken from a location this member reaches only when it has the declared digest."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from aiohttp import web

from agent.artifacts.fetcher import Sources as PeerSources
from agent.artifacts.fetches import Fetches
from agent.artifacts.sources import SourceError, Sources, shown
from agent.artifacts.store import ArtifactStore, describe_files
from agent.cluster.artifacts import Artifacts
from facts.artifacts import manifest_digest
from plane.db.devserver import free_port
from tests.fixtures.https_certs import make_ca, make_server_cert

BODY = os.urandom(3 * 65536 + 17)
SHA = hashlib.sha256(BODY).hexdigest()
TOKEN = "sig=very-secret-token"


class Files:
    """An HTTPS server of one file (`/models/tiny.gguf`), what it saw asked, its CA."""

    def __init__(self, ca_file: Path, url: str) -> None:
        self.ca_file = ca_file
        self.url = url
        self.asked: list[str] = []


@pytest.fixture
async def files(tmp_path: Path) -> AsyncIterator[Files]:
    ca_file, ca, ca_key = make_ca(tmp_path, "mirror-ca")
    cert_file, key_file = make_server_cert(tmp_path, ca, ca_key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    port = free_port()
    served = Files(Path(ca_file), f"https://127.0.0.1:{port}")

    async def model(request: web.Request) -> web.StreamResponse:
        served.asked.append(request.path_qs)
        if request.match_info["name"] == "tiny.gguf":
            return web.Response(body=BODY)
        if request.match_info["name"] == "huge.gguf":  # says more than any budget
            return web.Response(body=b"x", headers={"Content-Length": str(2**41)})
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/models/{name}", model)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=context).start()
    try:
        yield served
    finally:
        await runner.cleanup()


def _spawn(name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    coro.close()
    raise AssertionError("nothing is fetched from members here")


def sources(home: Path, ca_file: Path | None) -> Sources:
    store = ArtifactStore(home / "store")
    fetches = Fetches(store, list, cast(PeerSources, None), _spawn)
    return Sources(Artifacts(home, sign=lambda a: a), fetches, ca_file=ca_file)


def incoming(home: Path) -> list[Path]:
    folder = home / "store" / "incoming"
    return list(folder.iterdir()) if folder.exists() else []


async def test_a_urls_file_is_taken_when_its_sha256_matches(files: Files, tmp_path: Path) -> None:
    taken = sources(tmp_path, files.ca_file)
    made = await taken.take_url(f"{files.url}/models/tiny.gguf?{TOKEN}", "tiny", sha256=SHA)
    store = taken.fetches.store
    ready = store.resident(made.digest)
    assert ready is not None
    assert (ready / "tiny.gguf").read_bytes() == BODY
    assert taken.artifacts.get("tiny") == made  # named for every member
    assert incoming(tmp_path) == []  # the download is gone once taken


async def test_a_wrong_hash_plain_http_and_errors_are_refused_and_nothing_kept(
    files: Files, tmp_path: Path
) -> None:
    taken = sources(tmp_path, files.ca_file)
    url = f"{files.url}/models/tiny.gguf?{TOKEN}"
    with pytest.raises(SourceError, match="its SHA-256 is") as wrong:
        await taken.take_url(url, "tiny", sha256="0" * 64)
    assert TOKEN not in str(wrong.value)  # a signed link's token is never said
    with pytest.raises(SourceError, match="only https"):
        await taken.take_url(url.replace("https", "http"), "tiny", sha256=SHA)
    with pytest.raises(SourceError, match="answered 404"):
        await taken.take_url(f"{files.url}/models/none.gguf", "none", sha256=SHA)
    with pytest.raises(SourceError, match="too big"):
        await taken.take_url(f"{files.url}/models/huge.gguf", "huge", sha256=SHA)
    assert taken.artifacts.live() == []
    assert incoming(tmp_path) == []
    assert os.listdir(tmp_path / "store" / "ready") == []
    # The system's trust store does not know the test's CA: refused, not trusted blindly.
    untrusting = sources(tmp_path / "other", None)
    with pytest.raises(SourceError, match=r"(?i)certificate"):
        await untrusting.take_url(url, "tiny", sha256=SHA)
    assert len(files.asked) == 3  # the control: the server was asked (never over http)


async def test_a_plane_warm_artifact_is_taken_from_a_location_with_its_digest(
    files: Files, tmp_path: Path
) -> None:
    local = tmp_path / "weights"
    local.mkdir()
    (local / "tiny.gguf").write_bytes(BODY)
    digest = manifest_digest(describe_files(local / "tiny.gguf"))
    taken = sources(tmp_path, files.ca_file)
    # A location that is not what the plane declared is passed over; the URL is taken.
    (tmp_path / "other.gguf").write_bytes(b"not the weights")
    locations = [
        "/nowhere/tiny.gguf",
        str(tmp_path / "other.gguf"),
        f"{files.url}/models/tiny.gguf",
    ]
    assert await taken.plane_warm("art_" + "1" * 26, digest, locations)
    (held,) = taken.artifacts.live()
    assert (held.name, held.digest) == ("art_" + "1" * 26, digest)
    assert taken.fetches.store.resident(digest) is not None
    # Known to the cluster now: members fetch it from each other, nothing is taken again.
    assert not await taken.plane_warm("art_" + "1" * 26, digest, locations)
    assert len(files.asked) == 1
    # A local path of this member is a location too.
    again = sources(tmp_path / "b", None)
    assert await again.plane_warm("art_" + "2" * 26, digest, [str(local / "tiny.gguf")])
    ready = again.fetches.store.resident(digest)
    assert ready is not None
    assert msgspec.json.encode(sorted(os.listdir(ready))) == b'["tiny.gguf"]'


def test_a_url_is_shown_without_its_query() -> None:
    assert shown(f"https://hf.example/org/model/resolve/main/w.gguf?{TOKEN}") == (
        "https://hf.example/…/w.gguf"
    )
