"""The listener's book (netkit/sites.py) in memory, with a fake clock: who is
admitted, who is closed to make room, and what is never closed for a newcomer (issue 25,
item 1). The real sockets are tests/reliability/test_handshake_flood.py's."""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any, cast

import pytest

from netkit.sites import STALE_S, Bounds, _Book, _Bounded, quiet_accept_errors
from tests.fixtures.clock import FakeClock

BOUNDS = Bounds(
    max_connections=20,
    max_per_source=6,
    handshakes=10,
    handshakes_per_source=3,
    stranger_handshakes_per_s=2.0,  # a burst of 8 from one address, 32 from all
)


class Conn:
    """What the book asks of a connection: its address, whether it is idle or a member's,
    when it started, and how to close it."""

    def __init__(self, book: _Book, source: str) -> None:
        self.book, self.source = book, source
        self.idle, self.member, self.evicted = True, False, False
        self.started = book.clock()

    def evict(self) -> None:
        self.evicted = True
        self.book.forget(cast(_Bounded, self))


def admit(book: _Book, source: str, *, tls: bool = True) -> tuple[Conn, bool]:
    conn = Conn(book, source)
    return conn, book.admit(cast(Any, conn), tls)


def secure(book: _Book, conn: Conn, member: bool) -> None:
    conn.member = member
    book.secured(cast(_Bounded, conn), member)


def test_a_strangers_handshakes_are_rationed_per_address_and_in_all(
    fake_clock: FakeClock,
) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    results = []
    for _ in range(10):
        conn, ok = admit(book, "10.0.0.1")
        results.append(ok)
        if ok:
            secure(book, conn, member=False)  # done: no longer in its handshake
    assert results == [True] * 8 + [False] * 2  # the burst, then refused before any TLS
    fake_clock.advance(1.0)
    assert admit(book, "10.0.0.1")[1]  # two more a second
    # Every stranger's address together: a burst of 32, whatever the number of addresses.
    book = _Book(BOUNDS, clock=fake_clock)
    admitted = 0
    for i in range(40):
        conn, ok = admit(book, f"10.0.1.{i}")
        admitted += ok
        if ok:
            book.forget(cast(_Bounded, conn))
    assert admitted == 32


def test_a_members_address_is_not_rationed(fake_clock: FakeClock) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    conn, ok = admit(book, "10.0.0.9")
    assert ok
    secure(book, conn, member=True)
    for _ in range(50):  # far past a stranger's burst
        conn, ok = admit(book, "10.0.0.9")
        assert ok
        book.forget(cast(_Bounded, conn))


def test_a_handshake_in_progress_is_closed_for_a_newcomer_only_once_stale(
    fake_clock: FakeClock,
) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    first = [admit(book, "10.0.0.1")[0] for _ in range(3)]  # its cap in progress
    assert not admit(book, "10.0.0.1")[1]  # three young ones: refused, none closed
    assert not any(c.evicted for c in first)
    fake_clock.advance(STALE_S)
    assert admit(book, "10.0.0.1")[1]  # the oldest, a partial ClientHello by now, goes
    assert [c.evicted for c in first] == [True, False, False]


def test_a_members_connection_is_never_closed_for_a_newcomer(fake_clock: FakeClock) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    member, _ = admit(book, "10.0.0.9")
    secure(book, member, member=True)
    member.idle = True  # kept alive between requests
    strangers = []
    for _ in range(20):  # strangers at the member's own address, past its cap of 6
        conn, ok = admit(book, "10.0.0.9")
        assert ok
        secure(book, conn, member=False)
        strangers.append(conn)
    assert not member.evicted
    assert sum(not c.evicted for c in strangers) == BOUNDS.max_per_source
    assert [c.evicted for c in strangers[-6:]] == [False] * 6  # the oldest went first


def test_busy_connections_are_kept_and_the_newcomer_refused(fake_clock: FakeClock) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    busy = []
    for _ in range(BOUNDS.max_per_source):
        conn, ok = admit(book, "10.0.0.1", tls=False)
        assert ok
        conn.idle = False  # a whole request being served
        busy.append(conn)
    assert not admit(book, "10.0.0.1", tls=False)[1]
    assert not any(c.evicted for c in busy)
    busy[0].idle = True  # now waiting for its next request: it makes room
    assert admit(book, "10.0.0.1", tls=False)[1]
    assert busy[0].evicted


def test_a_connection_counts_until_its_descriptor_is_gone(fake_clock: FakeClock) -> None:
    book = _Book(BOUNDS, clock=fake_clock)
    conns = [admit(book, "10.0.0.1", tls=False)[0] for _ in range(BOUNDS.max_per_source)]
    for conn in conns:
        conn.idle = False  # closing gracefully but not gone: still busy for the book
    assert not admit(book, "10.0.0.1", tls=False)[1]
    book.forget(cast(_Bounded, conns[0]))  # its transport reported connection_lost
    assert admit(book, "10.0.0.1", tls=False)[1]


async def test_out_of_descriptors_is_logged_once_in_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(1000):  # asyncio's accept loop, out of descriptors
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(errno.EMFILE, "Too many open files"),
                    }
                )
            loop.call_exception_handler({"message": "something else"})  # the control
        messages = [r.getMessage() for r in caplog.records]
        assert messages == [
            "socket.accept() out of system resource (0 more not logged)",
            "something else",
        ]
    finally:
        loop.set_exception_handler(previous)
