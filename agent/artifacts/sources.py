"""Artifacts from outside the members (issue 28, item 6): files on this member's disk and
files behind an `https://` URL. Either way the bytes are checked before they count -- a
URL's file against the SHA-256 the operator gives, and the result against the digest the
plane declares when it declared one -- then taken into the store and named for every
member, who fetch them from here peer to peer.

- `take_local(path)`: an absolute path on this member (a file or a folder), hashed in
  pieces and copied into the store (`nvpair artifact add PATH`).
- `take_url(url, sha256)`: one file, downloaded over HTTPS (certificates checked against the
  system's trust store, or `[artifacts] ca_file`) into `incoming/` under the store,
  its SHA-256 checked as it streams, then taken like a local file and the download deleted
  (`nvpair artifact add https://… --sha256 HEX`). Plain `http://` is refused: weights are
  code an engine runs.
- `Sources.plane_warm(...)`: an artifact the plane puts in the cluster's warm set that the
  cluster does not know yet is taken from one of its locations that this member can reach
  (a path that exists here, an `https://` URL) when what it finds has the declared digest.

A URL may carry a token (a signed link): only its scheme, host and file name are ever
logged or said in an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import ssl
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Final

import aiohttp
import msgspec

from agent.artifacts.fetches import Fetches, FetchRefused
from agent.artifacts.store import StoreError, describe_files
from agent.cluster.artifacts import ArtifactRefused, Artifacts
from certs import make_private_dir
from facts.artifacts import PIECE_SIZE, Artifact, manifest_digest

__all__ = ["SourceError", "Sources", "shown"]

log = logging.getLogger(__name__)

CHUNK: Final = 1024 * 1024
NO_BUDGET_LIMIT: Final = 2**40  # a download's bound when the store has no budget: 1 TiB
RETRY_S: Final = 60.0  # a plane warm artifact whose locations failed is tried again after
_HEX64: Final = frozenset("0123456789abcdef")


class SourceError(Exception):
    """The artifact cannot be taken from that source (unreachable, not what was declared)."""


def shown(url: str) -> str:
    """A URL as it may be logged: scheme, host and file name, never a query or a token."""
    parts = urllib.parse.urlsplit(url)
    name = parts.path.rsplit("/", 1)[-1]
    return f"{parts.scheme}://{parts.hostname or '?'}/…/{name}"


class Sources:
    """Taking artifacts into this member's store from its disk and from URLs."""

    def __init__(
        self, artifacts: Artifacts, fetches: Fetches, *, ca_file: Path | None = None
    ) -> None:
        self.artifacts = artifacts
        self.fetches = fetches
        self.ca_file = ca_file  # trusted for downloads instead of the system's store
        self._tried: dict[str, float] = {}  # plane digest -> when its locations last failed

    async def take_local(
        self, source: Path, name: str, *, piece_size: int = PIECE_SIZE, digest: str = ""
    ) -> Artifact:
        """Hash `source` (a file or a folder here), take it into the store and name it for
        every member; SourceError when it is not `digest` (when given) or cannot be read,
        FetchRefused when the disk budget has no room for it."""
        store = self.fetches.store
        try:
            manifest = await asyncio.to_thread(describe_files, source, piece_size)
        except StoreError as exc:
            raise SourceError(str(exc)) from None
        found = manifest_digest(manifest)
        if digest and found != digest:
            raise SourceError(f"{source} is {found[:19]}, not {digest[:19]}")
        try:
            if await asyncio.to_thread(store.resident, found) is not None:
                await asyncio.to_thread(store.touch, found)  # the same files again: a use
            else:
                await asyncio.to_thread(self.fetches.make_room, manifest.size)
                await asyncio.to_thread(store.put_manifest, found, msgspec.json.encode(manifest))
                await asyncio.to_thread(store.import_files, source, found)
            return self.artifacts.add(name, manifest)
        except (StoreError, ArtifactRefused) as exc:  # FetchRefused (no room): as it is
            raise SourceError(str(exc)) from None

    async def take_url(
        self,
        url: str,
        name: str,
        *,
        sha256: str = "",
        piece_size: int = PIECE_SIZE,
        digest: str = "",
    ) -> Artifact:
        """Download one file from `url` (https only), check its SHA-256 (`sha256`, when
        given) and take it like a local file; the download is deleted either way."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise SourceError(f"{shown(url)}: only https:// URLs are taken")
        file_name = parts.path.rsplit("/", 1)[-1]
        if not file_name or file_name in (".", ".."):
            raise SourceError(f"{shown(url)}: the URL names no file")
        if sha256 and (len(sha256) != 64 or not set(sha256) <= _HEX64):
            raise SourceError("sha256: 64 lowercase hex digits")
        folder = self.fetches.store.root / "incoming" / uuid.uuid4().hex
        try:
            make_private_dir(folder.parent)
            make_private_dir(folder)
            target = folder / urllib.parse.unquote(file_name)
            got = await self._download(url, target)
            if sha256 and got != sha256:
                raise SourceError(f"{shown(url)}: its SHA-256 is {got[:12]}…, not {sha256[:12]}…")
            return await self.take_local(target, name, piece_size=piece_size, digest=digest)
        except OSError as exc:
            raise SourceError(f"{shown(url)}: {exc}") from None
        finally:
            await asyncio.to_thread(shutil.rmtree, folder, True)

    async def _download(self, url: str, target: Path) -> str:
        """Stream `url` into `target` (at most the store's budget, or 1 TiB), paced as
        fetches are; the file's SHA-256."""
        limit = self.fetches.budget or NO_BUDGET_LIMIT
        digest = hashlib.sha256()
        total = 0
        timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_read=60)
        trust: ssl.SSLContext | bool = True
        try:
            if self.ca_file is not None:
                trust = ssl.create_default_context(cafile=str(self.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise SourceError(f"[artifacts] ca_file {self.ca_file}: {exc}") from None
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, ssl=trust, allow_redirects=True, max_redirects=5) as response,
            ):
                if response.status != 200:
                    raise SourceError(f"{shown(url)}: answered {response.status}")
                if (response.content_length or 0) > limit:
                    raise SourceError(f"{shown(url)}: {response.content_length} bytes is too big")
                with target.open("wb") as out:
                    async for chunk in response.content.iter_chunked(CHUNK):
                        total += len(chunk)
                        if total > limit:
                            raise SourceError(f"{shown(url)}: more than {limit} bytes")
                        await self.fetches.pace.take(len(chunk))  # [artifacts] max_rate
                        digest.update(chunk)
                        out.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SourceError(f"{shown(url)}: {type(exc).__name__}: {exc}"[:300]) from None
        return digest.hexdigest()

    async def plane_warm(self, artifact_id: str, digest: str, locations: list[str]) -> bool:
        """Take an artifact the plane declared warm, that the cluster does not know, from
        the first of its `locations` this member reaches and that has `digest`; whether it
        was (tried again `RETRY_S` after its locations failed)."""
        if any(a.digest == digest for a in self.artifacts.live()):
            return False  # the cluster knows it: members fetch it from each other
        if time.monotonic() - self._tried.get(digest, -RETRY_S) < RETRY_S:
            return False
        self._tried[digest] = time.monotonic()
        if len(self._tried) > 1024:
            self._tried = {digest: self._tried[digest]}
        for location in locations:
            try:
                if location.startswith("/") and await asyncio.to_thread(Path(location).exists):
                    await self.take_local(Path(location), artifact_id, digest=digest)
                elif location.startswith("https://"):
                    await self.take_url(location, artifact_id, digest=digest)
                else:
                    continue
            except (SourceError, FetchRefused) as exc:
                log.info("warm artifact %s from %s: %s", artifact_id, _where(location), exc)
                continue
            log.info("warm artifact %s taken from %s", artifact_id, _where(location))
            self._tried.pop(digest, None)
            return True
        return False


def _where(location: str) -> str:
    return shown(location) if "://" in location else location
