"""The Jobs list's live feed: every job record this node commits, numbered, for the page.

`JobsStore.on_commit` hands each committed batch (local and relayed records alike) to
`JobFeed.publish`, which gives every record the next number of this agent start and keeps
the latest `RING` of them. A stream's event id is `<start id>-<number>`; a client that
reconnects with `Last-Event-ID` gets exactly the records after it -- no gap, no repeat --
or, when that point is no longer held (another agent start, older than the ring, unknown),
a `reset` at the current point (the page reloads its list and follows from there).

Each stream has a bounded queue (`QUEUE`): a client that does not keep up is dropped
(`Subscriber.dropped`; its `on_drop` closes the connection), never buffered without end; it
reconnects and resumes or resets. At most `MAX_STREAMS` streams at once. No I/O here: the
route (`agent.apis.page`) moves the frames.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
from collections.abc import Callable, Iterable
from typing import Final

__all__ = ["MAX_STREAMS", "QUEUE", "RING", "JobFeed", "Subscriber", "TooManyStreams"]

RING: Final = 10_000  # records held for reconnects (~400 bytes each)
QUEUE: Final = 2_000  # frames waiting for one client at most
MAX_STREAMS: Final = 16


class TooManyStreams(Exception):
    """`MAX_STREAMS` are open already (the client's to retry later)."""


class Subscriber:
    """One stream's queue of SSE frames; `wake` is set when there is something to send."""

    def __init__(self, limit: int) -> None:
        self.frames: collections.deque[bytes] = collections.deque()
        self.limit = limit
        self.wake = asyncio.Event()
        self.dropped = False
        self.on_drop: Callable[[], None] = lambda: None
        self.gone: Callable[[], bool] = lambda: False  # its client left (connection closed)

    def offer(self, frame: bytes) -> None:
        """Queue a frame; past the limit the subscriber is dropped and its queue emptied."""
        if self.dropped:
            return
        if len(self.frames) >= self.limit:
            self.dropped = True
            self.frames.clear()
            self.wake.set()
            self.on_drop()
            return
        self.frames.append(frame)
        self.wake.set()

    def take(self) -> list[bytes]:
        """Every queued frame, in order."""
        frames = list(self.frames)
        self.frames.clear()
        self.wake.clear()
        return frames


class JobFeed:
    """Numbers committed records, keeps a ring of the recent ones, fans out to streams."""

    def __init__(self, *, ring: int = RING, queue: int = QUEUE, streams: int = MAX_STREAMS):
        self.start_id = secrets.token_hex(6)  # another agent start: another id space
        self.seq = 0
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=ring)
        self.queue_limit = queue
        self._streams = streams
        self._subscribers: set[Subscriber] = set()
        self.dropped = 0  # subscribers cut for not keeping up

    def event_id(self, seq: int) -> str:
        """The stream id of record number `seq`."""
        return f"{self.start_id}-{seq}"

    def publish(self, records: Iterable[bytes]) -> None:
        """A committed batch (each record's JSON, as stored): number each record and hand
        it to every stream."""
        for record in records:
            self.seq += 1
            frame = self._frame(self.seq, record)
            self._ring.append((self.seq, frame))
            for subscriber in list(self._subscribers):
                subscriber.offer(frame)
                if subscriber.dropped:
                    self._subscribers.discard(subscriber)
                    self.dropped += 1

    def subscribe(self, last_event_id: str | None) -> Subscriber:
        """A new stream, its queue already holding what follows `last_event_id` (or a reset);
        `TooManyStreams` past the bound. Synchronous, so nothing is published in between."""
        for left in [s for s in self._subscribers if s.gone()]:
            # A client that left is noticed at its stream's next write; a new one need not
            # wait for that (a page reloaded a few times would otherwise fill every slot).
            self._subscribers.discard(left)
            left.wake.set()
        if len(self._subscribers) >= self._streams:
            raise TooManyStreams(f"{self._streams} streams are open already")
        subscriber = Subscriber(self.queue_limit)
        backlog = self.since(last_event_id) if last_event_id else []
        if backlog is None or len(backlog) > self.queue_limit:
            subscriber.offer(self.reset_frame())
        else:
            for frame in backlog:
                subscriber.offer(frame)
        self._subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """The stream ended."""
        self._subscribers.discard(subscriber)

    @property
    def streams(self) -> int:
        """Streams open now."""
        return len(self._subscribers)

    @property
    def subscribers(self) -> frozenset[Subscriber]:
        """The open streams' subscribers."""
        return frozenset(self._subscribers)

    def since(self, last_event_id: str) -> list[bytes] | None:
        """The frames after `last_event_id`, or None when that point is not held."""
        start, _, number = last_event_id.strip().rpartition("-")
        if start != self.start_id or not number.isdigit() or len(number) > 18:
            return None
        seq = int(number)
        if seq > self.seq:
            return None
        oldest = self._ring[0][0] if self._ring else self.seq + 1
        if seq < oldest - 1:
            return None  # some of what followed has left the ring
        return [frame for number, frame in self._ring if number > seq]

    def reset_frame(self) -> bytes:
        """`event: reset` at the current point: reload, then follow from this id."""
        return f"id: {self.event_id(self.seq)}\nevent: reset\ndata: {{}}\n\n".encode()

    def _frame(self, seq: int, record: bytes) -> bytes:
        return b"id: %s\nevent: job\ndata: %s\n\n" % (self.event_id(seq).encode(), record)
