"""Prefix-aware, load-bounded replica choice (`scheduler.prefix`, issue 29, item 2): a
conversation's turns share an anchor; the choice is the same from every member for the same
anchor and view, whatever order the member lists replicas in; no replica is pushed past the
bound by a flood of one anchor (the rest spill in the anchor's order); a replica that goes
moves only its own anchors; anchors spread over the replicas."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.prefix import BOUND, MIN_LIMIT, anchor_key, anchor_of, choose, limit, rendezvous

KEY = anchor_key(b"a cluster CA certificate")
SYSTEM = {"role": "system", "content": "You are a careful agent. Tools: search, read."}


def turn(*exchanges: str) -> dict[str, object]:
    messages: list[dict[str, str]] = [SYSTEM]
    for n, text in enumerate(exchanges):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def test_a_conversations_turns_share_their_anchor_and_others_do_not() -> None:
    first, _ = anchor_of(turn("what is in the report?"), KEY)
    later, _ = anchor_of(turn("what is in the report?", "it says x", "and y?"), KEY)
    other, _ = anchor_of(turn("summarise the minutes"), KEY)
    assert first == later
    assert first != other  # same system prompt, another conversation: spread
    assert anchor_of(turn("what is in the report?"), anchor_key(b"another CA"))[0] != first
    session, pinned = anchor_of(turn("x"), KEY, session="conv-7")
    assert pinned
    assert anchor_of({"prompt_cache_key": "conv-7", "messages": []}, KEY) == (session, True)
    text_a, _ = anchor_of({"prompt": "word " * 300 + "tail one"}, KEY)
    text_b, _ = anchor_of({"prompt": "word " * 300 + "tail two"}, KEY)
    assert text_a == text_b  # the same first 256 words
    assert anchor_of({"model": "m", "n": 2}, KEY) == (b"", False)  # nothing to anchor on
    # The Responses API: `instructions`, then `input` items, as chat's messages.
    asked = [{"role": "user", "content": [{"type": "input_text", "text": "q"}]}]
    answered = [*asked, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    one, _ = anchor_of({"instructions": "be brief", "input": asked}, KEY)
    assert one == anchor_of({"instructions": "be brief", "input": answered}, KEY)[0]
    assert one != anchor_of({"instructions": "be long", "input": asked}, KEY)[0]


replica_ids = st.lists(
    st.text(alphabet="abcdefgh0123456789", min_size=4, max_size=8), min_size=1, max_size=12,
    unique=True,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(replica_ids, st.binary(min_size=8, max_size=32), st.randoms(use_true_random=False))
def test_every_member_chooses_alike_whatever_order_it_lists_replicas_in(
    ids: list[str], anchor: bytes, rng: random.Random
) -> None:
    work = {r: float(rng.randint(0, 6)) for r in ids}
    ranked = [(r, f"nod_{r}", -work[r]) for r in sorted(ids, key=lambda r: (work[r], r))]
    shuffled = ids[:]
    rng.shuffle(shuffled)
    assert rendezvous(anchor, ids) == rendezvous(anchor, shuffled)
    one = choose(anchor, ranked, work)
    other = choose(anchor, ranked, dict(reversed(list(work.items()))))
    assert one == other
    assert one is not None
    if one.reason == "prefix":  # within the bound: its work and this one under the limit
        assert work[one.replica_id] + 1 <= limit(sum(work.values()), len(ids))
    else:  # every replica over the bound: the least loaded
        assert one.replica_id == ranked[0][0]


def test_an_idle_cluster_sends_each_anchor_to_its_first_replica() -> None:
    ids = [f"rep_{n}" for n in range(3)]
    ranked = [(r, "n", 0.0) for r in ids]
    for n in range(20):
        anchor, _ = anchor_of(turn(f"conversation {n}"), KEY)
        chosen = choose(anchor, ranked, dict.fromkeys(ids, 0.0))
        assert chosen is not None
        assert (chosen.replica_id, chosen.reason, chosen.rank) == (
            rendezvous(anchor, ids)[0],
            "prefix",
            0,
        )
    # Light load: at least MIN_LIMIT. Then 1.25 x the mean counting this one, rounded up.
    assert limit(0.0, 3) == limit(3.0, 3) == MIN_LIMIT == 3
    assert limit(35.0, 6) == 8  # 1.25 x 36 / 6 = 7.5, up
    assert limit(47.0, 6) == 10  # exactly 10


def test_a_flood_of_one_anchor_spills_in_its_order_and_stays_under_the_bound() -> None:
    ids = [f"rep_{n}" for n in range(6)]
    anchor, _ = anchor_of(turn("the one hot question"), KEY)
    order = rendezvous(anchor, ids)
    work = dict.fromkeys(ids, 0.0)
    for _ in range(60):  # each request stays: the flood piles up
        ranked = sorted(((r, "n", -w) for r, w in work.items()), key=lambda x: (-x[2], x[0]))
        chosen = choose(anchor, ranked, work)
        assert chosen is not None
        work[chosen.replica_id] += 1
    mean = sum(work.values()) / len(ids)
    assert max(work.values()) <= max(MIN_LIMIT, BOUND * (mean + 1))  # none past the bound
    assert work[order[0]] == max(work.values())  # the anchor's own replica took the most


def test_a_replica_that_goes_moves_only_its_own_anchors() -> None:
    ids = [f"rep_{n}" for n in range(5)]
    anchors = [anchor_of(turn(f"conversation {n}"), KEY)[0] for n in range(400)]
    before = {a: rendezvous(a, ids)[0] for a in anchors}
    gone = ids[2]
    after = {a: rendezvous(a, [r for r in ids if r != gone])[0] for a in anchors}
    moved = [a for a in anchors if before[a] != after[a]]
    assert moved
    assert all(before[a] == gone for a in moved)  # only the gone replica's anchors moved
    spread = Counter(before.values())
    assert min(spread.values()) > 400 / 5 / 2  # anchors spread over the replicas


def test_no_replica_no_choice_and_no_anchor_is_load() -> None:
    assert choose(b"x" * 16, [], {}) is None
    ranked = [("rep_b", "n2", -0.0), ("rep_a", "n1", -3.0)]
    chosen = choose(b"", ranked, {"rep_a": 3.0, "rep_b": 0.0})
    assert chosen is not None
    assert (chosen.replica_id, chosen.reason, chosen.rank) == ("rep_b", "load", -1)
