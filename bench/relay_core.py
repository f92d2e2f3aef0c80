"""Relay core throughput and dedup memory (issue 2).

Subject: peer frames through the manager's inter-node entry point -- JSON-RPC decode, typed
workload decode and validation, dedup, and the encoded `workloads:upsert` for the broker.
Baseline: bare msgspec decode + encode of the same frames (schema-less pass-through), in
the same run, interleaved. `ratio:` is for single frames (seed 002's notification, one per
payload). Members send each other batches (the broadcaster's JSON-RPC arrays, up to 1,024
events), so the same is measured first for payloads of `--batch` frames, the baseline
decoding the array and encoding each frame. Then the memory of the dedup state after
1,000,000 events over 10,000 live workloads, measured with tracemalloc.

    python bench/relay_core.py [--frames 100000] [--rounds 7] [--batch 64]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator

import msgspec
from _interleave import interleave

from workload_manager.manager import Manager
from workload_manager.relay import RelayCore

STATES = ["queued", "running", "completed"]
METHODS = ["workload:submitted", "workload:started", "workload:completed"]


def frame(run: int, workload: int, seq: int) -> bytes:
    """One ~340-byte peer frame, like a real lifecycle event."""
    phase = min(seq, 3) - 1 if seq <= 3 else 1  # queued, running, completed, then running again
    record = {
        "id": str(workload),
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "engine": "vllm",
        "runId": f"01jd{run:022d}",
        "state": STATES[phase],
        "originatedFrom": "nod_01jd8x3c5v0q2k9m4t7w1y6z8a",
        "scheduledOn": "nod_01jd8x3c5v0q2k9m4t7w1y6z8b",
        "createdAt": 1_764_000_000_000 + workload,
        "startedAt": 1_764_000_000_500 + workload if phase else None,
        "completedAt": 1_764_000_009_000 + workload if phase == 2 else None,
        "error": None,
        "requesterId": "team-search",
        "seq": seq,
    }
    message = {"jsonrpc": "2.0", "method": METHODS[phase], "params": {"workloadInfo": record}}
    return msgspec.json.encode(message)


def frames(count: int, workloads: int) -> Iterator[bytes]:
    """`count` frames over `workloads` workloads, each workload's seq rising."""
    for i in range(count):
        yield frame(0, i % workloads, i // workloads + 1)


def run_subject(data: list[bytes], frames: int | None = None) -> float:
    """Events/s through the manager; `frames`: how many events `data` holds (batched)."""
    events = len(data) if frames is None else frames
    sink: list[bytes] = []
    # A member with its identity, as every one that takes peers' payloads has (without one,
    # the manager would ask for it again on every payload).
    manager = Manager(
        version="bench", port=1, send_to_broker=sink.append, identity=lambda: "nod_bench_self"
    )
    start = time.perf_counter()
    handle = manager.handle_remote
    for payload in data:
        handle(payload, "nod_peer")
    elapsed = time.perf_counter() - start
    assert len(sink) == events, (len(sink), events)
    return events / elapsed


def run_baseline(data: list[bytes]) -> float:
    decode, encode = msgspec.json.decode, msgspec.json.encode
    sink: list[bytes] = []
    start = time.perf_counter()
    for payload in data:
        sink.append(encode(decode(payload)))
    elapsed = time.perf_counter() - start
    return len(data) / elapsed


def run_baseline_batches(data: list[bytes], frames: int) -> float:
    decode, encode = msgspec.json.decode, msgspec.json.encode
    sink: list[bytes] = []
    start = time.perf_counter()
    for payload in data:
        sink.extend(encode(item) for item in decode(payload))
    elapsed = time.perf_counter() - start
    return frames / elapsed


def dedup_memory(events: int, workloads: int) -> tuple[int, int]:
    """Bytes held by the relay state after `events` events over `workloads` workloads."""
    gc.collect()
    tracemalloc.start()
    manager = Manager(version="bench", port=1)
    before = tracemalloc.get_traced_memory()[0]
    for seq in range(1, events // workloads + 1):
        # every workload stays live (queued/running): the worst case for retention
        batch = [frame(0, w, seq) for w in range(workloads)]
        for payload in batch:
            manager.handle_remote(payload, "nod_peer")
    del batch
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    relay: RelayCore = manager.relay
    return held, relay.live_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--workloads", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=64, help="frames per batched payload")
    args = parser.parse_args()

    data = list(frames(args.frames, workloads=args.frames // 5))
    print(f"frames: {len(data):,}, mean size {sum(map(len, data)) / len(data):.0f} B")
    size = args.batch
    batches = [b"[" + b",".join(data[i : i + size]) + b"]" for i in range(0, len(data), size)]
    base: list[float] = []
    subject: list[float] = []
    for i in range(args.rounds):
        pair: list[tuple[list[float], Callable[[], float]]] = [
            (base, lambda: run_baseline_batches(batches, len(data))),
            (subject, lambda: run_subject(batches, len(data))),
        ]
        for rates, run in pair if i % 2 == 0 else pair[::-1]:
            rates.append(run())
    ratios = [s / b for b, s in zip(base, subject, strict=True)]
    print(
        f"relay core, batches of {size} (as members send them): baseline median "
        f"{statistics.median(base):,.0f} events/s, subject {statistics.median(subject):,.0f}; "
        f"per-round ratios {' '.join(f'{r:.2f}' for r in ratios)}, "
        f"median {statistics.median(ratios):.2f}"
    )
    interleave(
        lambda: run_baseline(data),
        lambda: run_subject(data),
        rounds=args.rounds,
        unit="events/s",
        label="relay core",
    )
    held, live = dedup_memory(args.events, args.workloads)
    print(
        f"dedup state: {held / 1e6:.1f} MB after {args.events:,} events "
        f"over {live:,} live workloads ({held / live:.0f} B per workload)"
    )


if __name__ == "__main__":
    main()
