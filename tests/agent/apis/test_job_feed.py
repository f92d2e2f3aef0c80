"""The live feed's numbering, ring and bounds, and the page's sessions, in memory (a fake
clock for the sessions): resume exactly after an id, `reset` when the point is not held,
a subscriber that does not keep up dropped, codes and sessions bounded and expiring."""

from __future__ import annotations

import msgspec
import pytest

from agent.apis.job_feed import JobFeed, TooManyStreams
from agent.apis.page_session import CODE_TTL_S, IDLE_S, MAX_CODES, MAX_SESSIONS, UiSessions
from tests.fixtures.records import workload_record
from workload_manager.workload import Workload


def record(wid: str, seq: int = 1) -> bytes:
    """A record's JSON, as the Jobs store commits it."""
    return msgspec.json.encode(msgspec.convert(workload_record(wid, seq), Workload))


def ids(frames: list[bytes]) -> list[str]:
    return [f.split(b"\n")[0].removeprefix(b"id: ").decode() for f in frames]


def test_a_reconnect_gets_exactly_what_followed_its_id() -> None:
    feed = JobFeed(ring=100)
    feed.publish([record("a"), record("b")])
    first = feed.subscribe(None)
    assert first.take() == []  # a new stream starts at the current point
    feed.publish([record("c"), record("d"), record("e")])
    seen = first.take()
    assert ids(seen) == [feed.event_id(n) for n in (3, 4, 5)]
    assert [b'"id":"c"' in f for f in seen] == [True, False, False]
    feed.unsubscribe(first)
    feed.publish([record("f")])
    again = feed.subscribe(ids(seen)[0])  # it saw 3 only, then lost the connection
    assert ids(again.take()) == [feed.event_id(n) for n in (4, 5, 6)]
    feed.publish([record("g")])
    assert ids(again.take()) == [feed.event_id(7)]
    caught_up = feed.subscribe(feed.event_id(7))
    assert caught_up.take() == []


@pytest.mark.parametrize(
    "last", ["other-3", "nonsense", "", "x-99999999999999999999", "-1", "{start}-9", "{start}-1"]
)
def test_a_point_not_held_is_a_reset_at_the_current_point(last: str) -> None:
    feed = JobFeed(ring=3)
    feed.publish([record(str(n)) for n in range(5)])  # the ring holds 3, 4, 5
    subscriber = feed.subscribe(last.format(start=feed.start_id) or "garbage")
    frames = subscriber.take()
    assert len(frames) == 1
    assert b"event: reset" in frames[0]
    assert ids(frames) == [feed.event_id(5)]
    # The control: the oldest point the ring still follows resumes.
    assert len(feed.subscribe(feed.event_id(2)).take()) == 3


def test_a_client_that_does_not_keep_up_is_dropped_and_others_are_not() -> None:
    feed = JobFeed(queue=5)
    cut: list[bool] = []
    slow, fast = feed.subscribe(None), feed.subscribe(None)
    slow.on_drop = lambda: cut.append(True)
    for n in range(20):
        feed.publish([record(str(n))])
        fast.take()
    assert (slow.dropped, cut, len(slow.frames)) == (True, [True], 0)
    assert (fast.dropped, feed.streams, feed.dropped) == (False, 1, 1)
    # A backlog longer than a queue is a reset, not a queue past its bound.
    late = feed.subscribe(feed.event_id(1))
    assert [b"event: reset" in f for f in late.take()] == [True]


def test_streams_are_bounded() -> None:
    feed = JobFeed(streams=2)
    one = feed.subscribe(None)
    feed.subscribe(None)
    with pytest.raises(TooManyStreams):
        feed.subscribe(None)
    feed.unsubscribe(one)
    left = feed.subscribe(None)  # the control: a slot freed is taken
    left.gone = lambda: True  # its client closed the connection: its slot is free too
    assert feed.subscribe(None) not in (one, left)
    assert left.wake.is_set()


def test_a_code_works_once_within_its_time() -> None:
    sessions = UiSessions()
    code = sessions.issue_code(now=0.0)
    session = sessions.redeem(code, now=1.0)
    assert session is not None
    assert sessions.valid(session, now=2.0)
    assert sessions.redeem(code, now=2.0) is None  # spent
    late = sessions.issue_code(now=10.0)
    assert sessions.redeem(late, now=10.0 + CODE_TTL_S) is None  # expired
    assert sessions.redeem(sessions.issue_code(now=20.0), now=19.0 + CODE_TTL_S) is not None
    assert not sessions.valid("x" * 1000, now=3.0)
    assert not sessions.valid(None, now=3.0)


def test_sessions_expire_idle_and_codes_and_sessions_are_bounded() -> None:
    sessions = UiSessions()
    first = sessions.redeem(sessions.issue_code(0.0), 0.0)
    assert sessions.valid(first, IDLE_S - 1)  # used: kept alive
    assert sessions.valid(first, 2 * IDLE_S - 2)
    assert not sessions.valid(first, 3 * IDLE_S)
    codes = [sessions.issue_code(5.0 * IDLE_S) for _ in range(MAX_CODES + 3)]
    assert sessions.counts[0] == MAX_CODES
    assert sessions.redeem(codes[0], 5.0 * IDLE_S) is None  # the oldest went
    live = [sessions.redeem(sessions.issue_code(6.0 * IDLE_S), 6.0 * IDLE_S) for _ in range(70)]
    assert sessions.counts[1] == MAX_SESSIONS
    assert not sessions.valid(live[0], 6.0 * IDLE_S)
    assert sessions.valid(live[-1], 6.0 * IDLE_S)
