"""`NodeClient`: every call this node makes to a member's node API, over cluster mTLS.

The one place that builds member URLs and client contexts: record pushes, forwarded
inference, cordon, cancel and anti-entropy rounds. The server's certificate is checked
against the cluster CA and the member's node id (`server_hostname_for`), so connecting by
IP address still names who must answer -- and, once connected, the server's certificate must
be that member's pin (`PinnedConnector`). Two sessions: short calls time out after 5 s;
forwarded inference has no total timeout (a generation may be long) but a connect timeout
and a read timeout between chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

import aiohttp
import msgspec

from agent.core.errors import MemberRefused, MemberUnreachable
from agent.core.request_identity import outgoing
from agent.engines import tunnel
from agent.engines.client import EngineHttp, EngineReply, Tls
from broker.anti_entropy import Differences, Digest, Exchange, ExchangeAnswer
from certs import (
    FORWARD_ALPN,
    CertsError,
    ClientContexts,
    ClusterDir,
    pinned_peer,
    server_hostname_for,
)
from facts.artifact_fetch import from_bitmap
from facts.artifacts import MAX_PIECE_SIZE
from facts.key_limits import LeaseAnswer, LeaseAsk
from facts.probing import Ping, PingReq, PingReqAnswer
from facts.records import NodeRecord, RecordsPush, push_decoder
from netkit.guard import PinnedConnector

__all__ = ["NodeClient"]

SHORT_TIMEOUT: Final = aiohttp.ClientTimeout(total=5)
LONG_TIMEOUT: Final = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=300)
_JSON: Final = {"Content-Type": "application/json"}
# A manifest of a million pieces is about 70 MB of JSON; one of 6,400 (100 GB) about 450 KB.
MANIFEST_LIMIT: Final = 80 * 1024 * 1024
MAX_MEMBERS_HELD: Final = 1024  # members whose connection settings are kept


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The whole body, or None when it is longer than `limit` (not read past it)."""
    if (response.content_length or 0) > limit:
        return None
    if response.content_length is not None:  # bounded by its length: read at once
        return await response.read()
    chunks, total = [], 0
    async for chunk in response.content.iter_chunked(256 * 1024):
        total += len(chunk)
        if total > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


class _Held(msgspec.Struct, frozen=True):
    count: int
    bitmap: str


_NETWORK_ERRORS: Final = (aiohttp.ClientError, TimeoutError, OSError, CertsError)
_differences: Final = msgspec.json.Decoder(Differences)
_exchanged: Final = msgspec.json.Decoder(ExchangeAnswer)
_ping: Final = msgspec.json.Decoder(Ping)
_ping_req: Final = msgspec.json.Decoder(PingReqAnswer)
_lease_answer: Final = msgspec.json.Decoder(LeaseAnswer)


class NodeClient:
    """Calls to members by node id; `record_of` says where a member is."""

    def __init__(
        self,
        cluster: ClusterDir,
        record_of: Callable[[str], NodeRecord | None],
        *,
        dial_from: str | None = None,
    ) -> None:
        self._contexts = ClientContexts(cluster)
        self._pins = cluster.pins
        self._record_of = record_of
        self._dial_from = dial_from
        self._short: aiohttp.ClientSession | None = None
        self._long: aiohttp.ClientSession | None = None
        self._forwards = EngineHttp()  # forwarded inference (`forward`)
        # ... whose connections offer FORWARD_ALPN: a member that knows it serves them on
        # its lean server, any other on aiohttp (HTTP/1.1 either way).
        self._forward_contexts = ClientContexts(cluster, alpn=(FORWARD_ALPN,))
        self._tls_for: dict[str, Tls] = {}  # node id -> how its connections are made

    async def aclose(self) -> None:
        """Close both sessions, the forwarding client and their connections."""
        for session in (self._short, self._long):
            if session is not None:
                await session.close()
        await self._forwards.aclose()

    def _base(self, node_id: str) -> str:
        record = self._record_of(node_id)
        if record is None or not record.addresses:
            raise MemberUnreachable(f"no address known for {node_id}")
        host = record.addresses[0]
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal
        return f"https://{host}:{record.nodePort}"

    def _session(self, long: bool = False) -> aiohttp.ClientSession:
        if long:
            if self._long is None:
                self._long = self._new_session(LONG_TIMEOUT)
            return self._long
        if self._short is None:
            self._short = self._new_session(SHORT_TIMEOUT)
        return self._short

    def _new_session(self, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
        # Connections leave from `dial_from` when it is set (`[agent] dial_from`).
        local = (self._dial_from, 0) if self._dial_from else None
        return aiohttp.ClientSession(
            timeout=timeout, connector=PinnedConnector(self._pins, local_addr=local)
        )

    async def _post(self, node_id: str, path: str, body: bytes) -> bytes:
        url = self._base(node_id) + path
        try:
            async with self._session().post(
                url,
                data=body,
                headers=_JSON,
                ssl=self._contexts.current(),
                server_hostname=server_hostname_for(node_id),
            ) as response:
                answer = await response.read()
                status = response.status
        except _NETWORK_ERRORS as exc:
            raise MemberUnreachable(f"{node_id}: {type(exc).__name__}: {exc}") from exc
        if status == 409:  # releases too far apart: the member says why, in our words
            raise MemberRefused(node_id, status, answer[:1024].decode(errors="replace").strip())
        if status != 200:
            raise MemberRefused(node_id, status)
        return answer

    async def _get(self, node_id: str, path: str, *, limit: int, long: bool = False) -> bytes:
        # GET `path`; an answer over `limit` bytes is the member's fault (never read whole).
        url = self._base(node_id) + path
        try:
            async with self._session(long).get(
                url, ssl=self._contexts.current(), server_hostname=server_hostname_for(node_id)
            ) as response:
                status = response.status
                read = await _read_at_most(response, limit if status == 200 else 4096)
                if read is None:
                    raise MemberUnreachable(f"{node_id} answered {path} with over {limit} bytes")
                answer = read
        except _NETWORK_ERRORS as exc:
            raise MemberUnreachable(f"{node_id}: {type(exc).__name__}: {exc}") from exc
        if status == 409:
            raise MemberRefused(node_id, status, answer.decode(errors="replace").strip())
        if status != 200:
            raise MemberRefused(node_id, status)
        return answer

    async def artifact_manifest(self, node_id: str, digest: str) -> bytes:
        """The manifest of `digest` as a member holds it (the caller checks it against the
        digest: `agent.artifacts.store.ArtifactStore.put_manifest`)."""
        return await self._get(
            node_id, f"/v1/artifacts/{digest[7:]}/manifest", limit=MANIFEST_LIMIT
        )

    async def artifact_held(self, node_id: str, digest: str, count: int) -> set[int]:
        """Which of the `count` pieces of `digest` a member holds."""
        body = await self._get(node_id, f"/v1/artifacts/{digest[7:]}/held", limit=MANIFEST_LIMIT)
        try:
            said = msgspec.json.decode(body, type=_Held)
            return from_bitmap(said.bitmap, count)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise MemberUnreachable(f"{node_id} answered /held with garbage: {exc}") from exc

    async def artifact_piece(self, node_id: str, digest: str, index: int) -> bytes:
        """Piece `index` of `digest` from a member (the caller checks its hash)."""
        path = f"/v1/artifacts/{digest[7:]}/pieces/{index}"
        return await self._get(node_id, path, limit=MAX_PIECE_SIZE, long=True)

    async def _call(self, node_id: str, path: str, value: object, decoder: Any) -> Any:
        # POST `value` as JSON, decode the answer; a malformed answer is the member's fault.
        body = await self._post(node_id, path, msgspec.json.encode(value))
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise MemberUnreachable(f"{node_id} answered {path} with garbage: {exc}") from exc

    async def push_records(self, node_id: str, push: RecordsPush) -> RecordsPush:
        """Send our records; the member answers with its own (one round trip each way)."""
        answer: RecordsPush = await self._call(node_id, "/v1/records", push, push_decoder)
        return answer

    async def ping(self, node_id: str, ping: Ping) -> Ping:
        """A probe (facts/probing.py): our digest and rumors there, the member's back."""
        answer: Ping = await self._call(node_id, "/v1/members/ping", ping, _ping)
        return answer

    async def ping_req(self, node_id: str, target: str) -> PingReqAnswer:
        """Ask a member to probe `target` for us (an indirect probe)."""
        answer: PingReqAnswer = await self._call(
            node_id, "/v1/members/ping-req", PingReq(target=target), _ping_req
        )
        return answer

    async def repair_digest(self, node_id: str, digest: Digest) -> Differences:
        """Anti-entropy, step 1: our digest there; its keys where the stores differ back."""
        answer: Differences = await self._call(node_id, "/v1/repair/digest", digest, _differences)
        return answer

    async def repair_exchange(self, node_id: str, exchange: Exchange) -> ExchangeAnswer:
        """Anti-entropy, step 2: the records it lacks there; those we asked for back."""
        answer: ExchangeAnswer = await self._call(
            node_id, "/v1/repair/exchange", exchange, _exchanged
        )
        return answer

    async def lease(self, node_id: str, ask: LeaseAsk) -> LeaseAnswer:
        """API keys' limits (agent.serving.cluster_limits): leases asked of, and tokens
        reported to, the member that holds the keys' counts."""
        answer: LeaseAnswer = await self._call(node_id, "/v1/limits/lease", ask, _lease_answer)
        return answer

    async def cordon(self, node_id: str, cordoned: bool) -> None:
        """Ask a member to cordon (or uncordon) itself: only it speaks for itself."""
        await self._post(node_id, "/v1/cordon", msgspec.json.encode({"cordoned": cordoned}))

    async def cancel(self, node_id: str, target: str) -> None:
        """Ask a member's facade to cancel what it placed on `target` (a forced drain)."""
        await self._post(node_id, "/v1/cancel", msgspec.json.encode({"target": target}))

    def tunnel(self, node_id: str, replica: str) -> Any:
        """A WebSocket to `replica`'s engine on `node_id` (`agent.engines.tunnel`); an aiohttp
        context. `MemberUnreachable` when no address of the member is known."""
        return self._session(long=True).ws_connect(
            self._base(node_id) + f"/v1/tunnel/{replica}",
            ssl=self._contexts.current(),
            server_hostname=server_hostname_for(node_id),
            max_msg_size=tunnel.MAX_MESSAGE,
            heartbeat=tunnel.HEARTBEAT_S,
        )

    def forward(
        self,
        node_id: str,
        path: str,
        body: bytes,
        replica: str = "",
        content_type: str = "application/json",
    ) -> AbstractAsyncContextManager[EngineReply]:
        """POST a request to run on `node_id` (on `replica` there, when given), its body
        with the `content_type` the engine is to get; a request context (streamed back).

        Carried by the facade's own HTTP/1.1 client (`agent.engines.client`, issue 33) on
        connections kept per member: TLS set up and the member's pin checked once per
        connection, not per request."""
        headers = {"Content-Type": content_type, "X-Nvpair-Path": path, **outgoing()}
        if replica:
            headers["X-Nvpair-Replica"] = replica
        return self._forwards.post(
            self._base(node_id), "/v1/forward", body, headers, self._tls(node_id)
        )

    def _tls(self, node_id: str) -> Tls:
        try:
            context = self._forward_contexts.current()
        except CertsError as exc:
            raise MemberUnreachable(f"{node_id}: {exc}") from exc
        held = self._tls_for.get(node_id)
        if held is None or held.context is not context:
            if len(self._tls_for) >= MAX_MEMBERS_HELD:
                self._tls_for.clear()
            pins = self._pins
            held = self._tls_for[node_id] = Tls(
                context,
                server_hostname_for(node_id),
                lambda ssl_object: pinned_peer(ssl_object, pins) == node_id,
                (self._dial_from, 0) if self._dial_from else None,
            )
        return held
