"""bench/scale.py: its arithmetic on known readings, and one short run at four members."""

from __future__ import annotations

import importlib
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    # bench/ is a folder of scripts, not a package: its modules import each other by name.
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module("_scale_figures")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_percentile_is_nearest_rank(figures: ModuleType) -> None:
    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert figures.percentile(values, 0.5) == 50.0
    assert figures.percentile(values, 0.99) == 99.0
    assert figures.percentile(values, 1.0) == 100.0
    assert figures.percentile([7.0], 0.99) == 7.0
    assert math.isnan(figures.percentile([], 0.5))


def test_counter_deltas_sum_over_members(figures: ModuleType) -> None:
    before = [
        {"counters": {"received_remote": 10}, "broadcast": [{"sent": 3}, {"sent": 4}]},
        {"counters": {"received_remote": 0}, "broadcast": []},
    ]
    after = [
        {"counters": {"received_remote": 19}, "broadcast": [{"sent": 5}, {"sent": 9}]},
        {"counters": {"received_remote": 6}, "broadcast": []},
    ]
    assert figures.counter_delta(before, after, "received_remote") == 15
    assert figures.outbox_delta(before, after) == 7
    assert figures.outbox_delta(before, before, "sent") == 0


def test_proc_readings(figures: ModuleType) -> None:
    # A command name with spaces and parentheses; utime 1234 and stime 56 (fields 14, 15).
    line = "4242 (python -m (x)) S 1 2 3 4 5 6 7 8 9 10 1234 56 0 0 20 0 3 0 100 0 0"
    assert figures.cpu_ticks(line) == 1290
    own = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert figures.cpu_ticks(own) >= 0
    assert figures.rss_kib("Name:\tpython\nVmRSS:\t  53248 kB\n") == 53248
    assert figures.rss_kib("Name:\tzombie\n") == 0


def test_wire_bytes_from_ss_counts_only_our_ports(figures: ModuleType) -> None:
    before = (
        "0 0 127.0.0.1:21000 127.0.0.1:40000\n\t cubic bytes_sent:100 bytes_acked:101\n"
        "0 0 127.0.0.1:40000 127.0.0.1:21000\n\t cubic bytes_sent:50 bytes_received:100\n"
        "0 0 127.0.0.1:5432 127.0.0.1:41000\n\t cubic bytes_sent:999999\n"
    )
    after = (
        "0 0 127.0.0.1:21000 127.0.0.1:40000\n\t cubic bytes_sent:300\n"
        "0 0 127.0.0.1:40000 127.0.0.1:21000\n\t cubic bytes_sent:80\n"
        "0 0 127.0.0.1:40001 127.0.0.1:21000\n\t cubic bytes_sent:20\n"  # a new connection
        "0 0 127.0.0.1:5432 127.0.0.1:41000\n\t cubic bytes_sent:9999999\n"
    )
    ports = {21000}
    first = figures.wire_bytes(before, ports)
    assert first == {(21000, 40000): 100, (40000, 21000): 50}
    assert figures.wire_delta(first, figures.wire_bytes(after, ports)) == 200 + 30 + 20


def test_the_ratio_is_flood_over_ring_at_the_largest_size_both_ran(figures: ModuleType) -> None:
    def size(n: int, relay: str, deliveries: int) -> object:
        return figures.SizeFigures(
            members=n, relay=relay, events=10, offered_rate=10.0, deliveries=deliveries,
            first_seen=10 * n, outbox_sent=deliveries, retried=0, wire_bytes=0, cpu_s=0.0,
            window_s=1.0, idle_cores=0.0, spreads_ms=[], missing=0, rss_mib=[], fds=[],
        )  # fmt: skip

    runs = [
        size(4, "flood", 90),
        size(4, "ring", 60),
        size(16, "flood", 2250),
        size(16, "ring", 300),
    ]
    assert figures.ratio(runs) == pytest.approx(2250 / 300)
    assert figures.ratio([size(16, "ring", 300)]) == pytest.approx(30 / 16)


def test_idle_samples_count_member_connections_once_and_print_flat_readings() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        watch = importlib.import_module("_idle_watch")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    ss = (
        "0 0 127.0.0.1:21000 127.0.0.1:40000\n\t cubic bytes_sent:1\n"  # a's end, b's client
        "0 0 127.0.0.1:40000 127.0.0.1:21000\n\t cubic bytes_sent:1\n"  # b's client end
        "0 0 127.0.0.1:40001 127.0.0.1:21001\n\t cubic bytes_sent:1\n"  # a's client end
        "0 0 127.0.0.1:21001 127.0.0.1:40001\n\t cubic bytes_sent:1\n"
        "0 0 127.0.0.1:5432 127.0.0.1:41000\n\t cubic bytes_sent:1\n"  # not a member's
    )
    assert watch.connections(ss, {21000, 21001}) == 2
    sample = watch.IdleSample(
        members=2, at_s=30.0, span_s=30.0, cpu_s=0.6, rss_mib=[50.0, 52.0], fds=[9, 9],
        connections=2,
    )  # fmt: skip
    assert sample.cores == pytest.approx(0.02)
    assert sample.line("hold") == (
        "  N=2 hold +30s: cpu 0.020 cores over 30 s; rss/manager 50..52 (median 50) MiB; "
        "fds/manager 9..9 (median 9); connections 2 (1.0/manager)"
    )
