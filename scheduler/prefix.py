"""Prefix-aware, load-bounded replica choice (issue 29, item 2). Pure: no I/O, no clock.

Every member accepts requests and there is no central router, so the choice must be a
function of what every member has: the request and the shared view of the replicas. A
request is reduced to its **anchor**: a keyed hash of the part of its prompt that every
later turn of the same conversation repeats -- for chat, the messages up to and including
the first user message (the system prompt, tools and the question that started it); for
a plain completion, its first `ANCHOR_WORDS` words -- or, when the client names one, its
session key (`prompt_cache_key`, `X-Session-Id`). An anchor never leaves the member that
computed it -- nothing about a request crosses to the others to route it -- and it is keyed
with a value every member derives alike (`anchor_key`), so one cluster's anchors say
nothing about another's and no table of plain hashes of common prompts applies.

The replicas that can take the request (`scheduler.replicas.rank_replicas`) are put in
**rendezvous order** for the anchor (highest random weight: each replica's weight is a hash
of the anchor and its id), and the first whose work is within the **bound** wins: a replica
may take a request while its work plus this one stays within `BOUND` times the mean work
counting this one, rounded up (`limit`: consistent hashing with bounded loads, as Mirrokni,
Thorup and Zadimoghaddam bound each bin by the ceiling of c times the average), and never
under `MIN_LIMIT` requests. So the turns of a conversation -- and
every request with the same anchor -- go to one replica, whose cache holds their prefix,
from whichever member they enter; a replica that goes moves only its own anchors (each to
its next in order), and a flood of one anchor spills to the next replicas in its order
instead of piling onto one. When no replica is within the bound (all equally loaded at
the bound), today's load ranking decides.

Two members choose the same replica for the same anchor whenever their views of the
replicas and their work agree; their work figures differ by the requests each has in flight
that the last load reports (about a second old) do not show yet, which can only change a
choice for a replica within that much of its bound.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "ANCHOR_WORDS",
    "BOUND",
    "MIN_LIMIT",
    "Choice",
    "anchor_key",
    "anchor_of",
    "choose",
    "fits",
    "limit",
    "rendezvous",
]

BOUND: Final = 1.25  # a replica takes an anchor's request while under 1.25 x (mean work + 1)
# ... or while it has fewer than this: an engine batches a few requests at little cost, and
# a load report a second old may still count one that has finished -- under light load the
# cache wins.
MIN_LIMIT: Final = 3
ANCHOR_WORDS: Final = 256  # a completion's anchor: its first words
MAX_ANCHOR_BYTES: Final = 1 << 20  # what is hashed of a prompt at most

Reason = Literal["session", "prefix", "load"]


@dataclass(frozen=True, slots=True)
class Choice:
    """The replica chosen and why: its anchor's (`prefix`, `session`) within the bound, or
    the least loaded (`load`: no anchor, or every replica in its order over the bound)."""

    replica_id: str
    node_id: str
    reason: Reason
    rank: int  # its place in the anchor's rendezvous order (0: the first); -1 by load


def anchor_key(cluster_ca_der: bytes) -> bytes:
    """The key anchors are hashed with: every member holds the cluster CA's certificate, so
    every member computes the same anchor for the same prompt."""
    return hashlib.sha256(b"nvpair prefix routing\x00" + cluster_ca_der).digest()


def anchor_of(body: Mapping[str, Any], key: bytes, *, session: str = "") -> tuple[bytes, bool]:
    """The request's anchor and whether it is a session's (a client's key, `session` or
    `prompt_cache_key`); (b"", False) when the body has nothing to anchor on."""
    named = session or body.get("prompt_cache_key")
    if isinstance(named, str) and named:
        return _keyed(key, b"session\x00" + named.encode("utf-8", "replace")[:1024]), True
    messages = body.get("messages")
    given = body.get("input")  # the Responses API: `instructions`, then `input`
    if messages is None and isinstance(given, list):
        messages = given
    if isinstance(messages, list):
        parts: list[bytes] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            parts.append(b"instructions\x00" + _text(instructions) + b"\x01")
        for message in messages:
            if not isinstance(message, Mapping):
                break
            role = str(message.get("role", ""))
            parts.append(role.encode() + b"\x00" + _text(message.get("content")) + b"\x01")
            if role == "user":
                break
        anchor = b"".join(parts)[:MAX_ANCHOR_BYTES]
        return (_keyed(key, b"chat\x00" + anchor), False) if anchor else (b"", False)
    prompt = body.get("prompt", given)
    if isinstance(prompt, str) and prompt:
        words = " ".join(prompt[:MAX_ANCHOR_BYTES].split()[:ANCHOR_WORDS])
        return _keyed(key, b"text\x00" + words.encode("utf-8", "replace")), False
    return b"", False


def _text(content: object) -> bytes:
    # A message's content: a string, or OpenAI's list of parts (their text parts, in order).
    if isinstance(content, str):
        return content.encode("utf-8", "replace")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "\x02".join(t for t in texts if isinstance(t, str)).encode("utf-8", "replace")
    return b""


_KEYED: dict[bytes, Any] = {}  # key -> its HMAC-SHA256 object, keyed once (one key a run)


def _keyed(key: bytes, data: bytes) -> bytes:
    # A copy of an HMAC already keyed: keying (and OpenSSL's look-up of SHA-256 by name,
    # which in the agent's process measured over 30 us) is done once, not per request.
    base = _KEYED.get(key)
    if base is None:
        if len(_KEYED) >= 16:
            _KEYED.clear()
        base = _KEYED[key] = hmac.new(key, digestmod=hashlib.sha256)
    keyed = base.copy()
    keyed.update(data)
    digest: bytes = keyed.digest()
    return digest


def rendezvous(anchor: bytes, replica_ids: Sequence[str]) -> list[str]:
    """The replicas in the anchor's order: by the weight `hash(anchor, id)`, highest first
    (ties, which need a hash collision, by id)."""

    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(replica_id.encode(), key=anchor[:64], digest_size=16).digest()

    return sorted(replica_ids, key=lambda r: (weight(r), r), reverse=True)


def limit(total_work: float, replicas: int, bound: float = BOUND) -> int:
    """The most work a replica may have with the request on it: `bound` x the mean work
    counting the request, rounded up, and never under `MIN_LIMIT`."""
    mean = (max(0.0, total_work) + 1) / max(1, replicas)
    return max(MIN_LIMIT, math.ceil(bound * mean - 1e-9))


def fits(work: float, most: int) -> bool:
    """Whether a replica with `work` on it may take one more under the limit `most`."""
    return max(0.0, work) + 1 <= most


def choose(
    anchor: bytes,
    ranked: Sequence[tuple[str, str, float]],
    work: Mapping[str, float],
    *,
    session: bool = False,
    bound: float = BOUND,
) -> Choice | None:
    """Among `ranked` (replica id, node id, load score: the replicas that can take the
    request, best first), the anchor's replica within the bound, else the best ranked;
    `work` is each one's work (requests on it, as the load score counts them). None when
    no replica can take it."""
    if not ranked:
        return None
    if anchor:
        total = sum(max(0.0, work.get(r, 0.0)) for r, _, _ in ranked)
        most = limit(total, len(ranked), bound)
        nodes = {r: n for r, n, _ in ranked}
        for place, replica_id in enumerate(rendezvous(anchor, list(nodes))):
            if fits(work.get(replica_id, 0.0), most):
                return Choice(
                    replica_id, nodes[replica_id], "session" if session else "prefix", place
                )
    best, node, _ = ranked[0]
    return Choice(best, node, "load", -1)
