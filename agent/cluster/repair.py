"""Anti-entropy rounds with the other members (the decisions are `broker.anti_entropy`'s).

Every `INTERVAL_S` this node takes the next reachable member in turn and compares Jobs
stores with it: a digest there, the differing buckets' keys back, then the records each side
lacks both ways. Whatever made two stores differ -- a frame dropped on the way, a row lost
behind the agent's back, a peer's events lost for a while -- is repaired within a few rounds,
without a reconnect. The same object answers the other side of a round (node API).

A node's own jobs are its own (docs/security.md): a round never hands a member its own, never
asks a member to change one of ours, and what a member sends claiming to originate here -- a
record or a removal -- is dropped and counted (`own_origin`), never stored or relayed. The
one exception is a row of our own that our store lost altogether (a disk that dropped its last
commits, a row deleted behind the agent's back, `jobs.db` deleted): we ask for it back
ourselves, as the initiator, and take it only for a key we asked for and do not hold -- and we
ask only for keys of a run we can show is ours (`own_run`: the run book, `agent.serving.run_book`).
A row a member holds in our name under any other run is one we never made: not asked for,
counted (`unproven_own`, `nvpair_anti_entropy_unproven_own_total`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from typing import Final, TypeVar

from agent.core.errors import MemberRefused, MemberUnreachable
from broker.anti_entropy import (
    MAX_KEYS,
    Differences,
    Digest,
    Exchange,
    ExchangeAnswer,
    JobKey,
    differing,
    plan_repair,
    removal_bucket,
)
from broker.digest_book import REBUILD_S, DigestBook
from broker.errors import BrokerError
from broker.jobs import JobsStore, JobsWriter
from broker.repair_reads import book_rows, compared_removals, data_version, records_for
from workload_manager.workload import Workload, WorkloadRemoval

__all__ = ["AntiEntropy", "RepairCounters"]

log = logging.getLogger(__name__)

INTERVAL_S: Final = 5.0
# Left out of the comparison on both sides: finished jobs within an hour of the retention
# (pruning takes them) and removals within an hour of their expiry (a day).
MARGIN_S: Final = 3600.0
REMOVAL_KEEP_S: Final = 86_400.0
# A record is handed on only once it has been in this store this long: one that came
# moments ago is most likely still on its way to the other member through the relay, and
# repairing it too delivers it there twice (~13,000 times per member in a 5-minute soak).
SETTLE_S: Final = 3.0

_Event = TypeVar("_Event", Workload, WorkloadRemoval)


@dataclass
class RepairCounters:
    """What the rounds did, for metrics."""

    rounds: int = 0
    failed: int = 0
    differing_buckets: int = 0
    records_in: int = 0
    records_out: int = 0
    own_origin: int = 0  # records and removals a member sent claiming this node's origin
    unproven_own: int = 0  # rows a member holds in this node's name, of a run it never made
    loads: int = 0  # times the store was read whole for the digest (else moved by commits)


class AntiEntropy:
    """Both sides of anti-entropy for one node."""

    def __init__(
        self,
        *,
        node_id: str | None = None,
        store: JobsStore,
        writer: JobsWriter,
        peers: Callable[[], list[str]],
        digest_at: Callable[[str, Digest], Awaitable[Differences]],
        exchange_at: Callable[[str, Exchange], Awaitable[ExchangeAnswer]],
        retention_h: float,
        interval_s: float = INTERVAL_S,
        relay: Callable[[Workload], None] = lambda record: None,
        relay_removal: Callable[[WorkloadRemoval], None] = lambda removal: None,
        own_run: Callable[[str], bool] = lambda run_id: False,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._node_id = node_id
        self._store = store
        self._writer = writer
        self._peers = peers
        self._digest_at = digest_at
        self._exchange_at = exchange_at
        # What a repair takes is handed to our workload manager as well, as a local event:
        # its relay then knows the record (a later delivery of it is a duplicate it drops,
        # not one it hands our broker again) and passes it on to any peer still without it.
        self._relay = relay
        self._relay_removal = relay_removal
        # Whether a runId is one of ours (the run book): only such rows are asked back.
        self._own_run = own_run
        self._retention_s = retention_h * 3600
        self._interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._turn = 0
        # The digest of our store, moved by each commit (`broker.digest_book`); read whole
        # again only when it must be.
        self._book = DigestBook()
        store.on_written = self._book.written
        self._version: int | None = None  # SQLite's data_version when the book was loaded
        self._reading = asyncio.Lock()
        self.counters = RepairCounters()

    async def run(self) -> None:
        """A round with the next member every `interval_s`, forever."""
        while True:
            await self._sleep(self._interval_s)
            peers = self._peers()
            if not peers:
                continue
            peer = peers[self._turn % len(peers)]
            self._turn += 1
            try:
                await self.round_with(peer)
            except (MemberUnreachable, MemberRefused, BrokerError, sqlite3.Error) as exc:
                self.counters.failed += 1
                log.debug("anti-entropy with %s failed: %s", peer, exc)

    async def _local(self) -> tuple[DigestBook, Digest]:
        await self._writer.flush()  # what was handed in is compared too
        async with self._reading:  # one load at a time: a round and a peer's may overlap
            now = self._clock()
            version = await data_version(self._store)
            book = self._book
            if book.stale or version != self._version or now - book.loaded_at >= REBUILD_S:
                # Read whole again: at start, after a removal or a prune, when another
                # connection wrote the file, and every REBUILD_S (the removals' window moves).
                book.begin_load()
                self._version = version
                self.counters.loads += 1
                try:
                    rows = await book_rows(self._store)
                    since = now - REMOVAL_KEEP_S + MARGIN_S
                    book.load(rows, await compared_removals(self._store, since=since), now)
                except BaseException:
                    book.stale = True  # not loaded: the next round reads it again
                    raise
            return book, book.digest(int((now - self._retention_s + MARGIN_S) * 1000))

    async def round_with(self, peer: str) -> int:
        """One round as the initiator; returns how many records moved either way."""
        book, mine = await self._local()
        theirs = await self._digest_at(peer, mine)
        self.counters.rounds += 1
        if not theirs.buckets:
            return 0
        buckets = set(theirs.buckets)
        self.counters.differing_buckets += len(buckets)
        removed = book.removed
        mine_removed = {r for r in removed if removal_bucket(*r) in buckets}
        plan = plan_repair(book.keys_in(buckets), mine_removed, theirs, all_my_removed=set(removed))
        # Neither side's own jobs go to it: it is their only writer -- except a row of its
        # own that its store lost altogether (a disk that dropped its last commits, a row
        # deleted behind its back), which it asks back for itself, never to change one it has,
        # and only of a run it can show it made (a member may hold one it made up).
        own = self._node_id
        their_keys = [key for key in plan.give if key[0] != peer]
        give = await records_for(self._store, their_keys, stored_before=self._settled())
        removals = [_removal(pair) for pair in plan.give_removals if pair[0] != peer]
        want = self._wanted(plan.want, book)
        answer = await self._exchange_at(peer, Exchange(records=give, removals=removals, want=want))
        for pair in plan.take_removals:
            if pair[0] != own:
                self._take_removal(_removal(pair))
        lost = {key for key in want if key[0] == own}
        for record in answer.records:
            if record.originatedFrom != own:
                self._take(record)
            elif (record.originatedFrom, record.runId, record.id) in lost:
                self._take(record)  # its own row back (its relay lost it with the store)
            else:
                self._not_own([record])
        self.counters.records_in += len(answer.records) + len(plan.take_removals)
        self.counters.records_out += len(give) + len(removals)
        moved = len(answer.records) + len(give) + len(plan.take_removals) + len(removals)
        if moved:
            log.info("anti-entropy with %s: %d record(s) and removal(s) repaired", peer, moved)
        return moved

    def _wanted(self, keys: list[JobKey], held: Container[JobKey]) -> list[JobKey]:
        # Another node's keys, all; ours only when lost here and of a run of ours.
        own, own_run = self._node_id, self._own_run
        want: list[JobKey] = []
        unproven = 0
        for key in keys:
            if key[0] != own:
                want.append(key)
            elif key in held:
                continue  # never a change to a row of ours we hold
            elif own_run(key[1]):
                want.append(key)
            else:
                unproven += 1
        if unproven:
            self.counters.unproven_own += unproven
            log.debug(
                "did not ask back %d row(s) in this node's name of runs it never made", unproven
            )
        return want

    def _not_own(self, events: list[_Event]) -> list[_Event]:
        # A member's record or removal claiming to originate here is a forgery: dropped.
        kept = [event for event in events if event.originatedFrom != self._node_id]
        if len(kept) != len(events):
            self.counters.own_origin += len(events) - len(kept)
            log.warning("dropped %d event(s) a member sent as this node's", len(events) - len(kept))
        return kept

    def _settled(self) -> float:
        return self._clock() - SETTLE_S

    def _take(self, record: Workload) -> None:
        self._writer.upsert(record)
        self._relay(record)

    def _take_removal(self, removal: WorkloadRemoval) -> None:
        self._writer.remove(removal)
        self._relay_removal(removal)

    async def answer_digest(self, theirs: Digest) -> Differences:
        """The responder's side of step 2: our keys and removals where the digests differ."""
        book, mine = await self._local()
        buckets = differing(mine, theirs)
        wanted = set(buckets)
        keys = book.keys_in(buckets)
        return Differences(
            buckets=buckets,
            keys=[(*key, seq) for key, seq in keys.items()][:MAX_KEYS],
            removed=[r for r in book.removed if removal_bucket(*r) in wanted][:MAX_KEYS],
        )

    async def answer_exchange(self, exchange: Exchange) -> ExchangeAnswer:
        """Take what the initiator sends (newest seq wins) and send what it asked for."""
        for removal in self._not_own(exchange.removals):
            self._take_removal(removal)
        for record in self._not_own(exchange.records):
            self._take(record)
        self.counters.records_in += len(exchange.records) + len(exchange.removals)
        records = await records_for(self._store, exchange.want, stored_before=self._settled())
        self.counters.records_out += len(records)
        return ExchangeAnswer(records=records)


def _removal(pair: tuple[str, str]) -> WorkloadRemoval:
    origin, wid = pair
    return WorkloadRemoval(workloadId=wid, originatedFrom=origin)
