"""What reading a records push costs now that its signed items are kept as signed (issue
27): a push of `--records` node records (each with 8 GPUs and 2 replicas) from a member,
taken the way `facts.membership.plan_push` takes it -- decoded, and for each record the
bytes its signature covers -- against the way before (one typed decode of the whole push,
then each record re-encoded with an empty signature). Signatures are not checked here:
both ways hash and verify the same bytes, through the same cache.

    python bench/records_push.py [--records 64] [--pushes 400] [--rounds 9]

The ratio is pushes per second now over before (higher is better; below 1: it costs more).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import msgspec
from _interleave import interleave

from facts.inventory import Device
from facts.kept import raws
from facts.membership import _decoded
from facts.record_signing import signed_bytes, signed_payload
from facts.records import NodeRecord, RecordsPush, Replica, push_decoder


class _Before(msgspec.Struct, kw_only=True, frozen=True):
    """The push as it was decoded before: typed all the way down."""

    records: list[NodeRecord] = []


def _record(n: int) -> NodeRecord:
    node = f"nod_{n:026d}"
    devices = [
        Device(
            id=f"gpu-{node}-{g}",
            uuid=f"GPU-{n:08d}-{g:04d}",
            index=g,
            name="NVIDIA H100 80GB HBM3",
            deviceClass="h100-80gb-sxm",
            memoryTotal=80 * 2**30,
            memoryUsed=2**30,
            memoryFree=79 * 2**30,
            utilization=12,
            temperatureC=41,
            powerW=310.5,
            eccUncorrected=0,
            health="ok",
            domainId=f"dom-{node}",
        )
        for g in range(8)
    ]
    replicas = [
        Replica(
            id=f"rep_{n:024d}{r:02d}",
            deployment="chat",
            deploymentId="dep_" + "0" * 26,
            spec="a" * 16,
            port=18000 + r,
            state="ready",
            running=3.0,
            waiting=1.0,
            loadAt=1_764_000_000_000,
        )
        for r in range(2)
    ]
    return NodeRecord(
        nodeId=node,
        name=f"m{n}",
        addresses=["10.0.0.1"],
        managerPort=14320,
        nodePort=14321,
        facadePort=14323,
        version="0.2.0",
        devices=devices,
        replicas=replicas,
        updatedAt=1_764_000_000_000,
        generation=1_764_000_000_000,
        signature="A" * 96,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--pushes", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    body = msgspec.json.encode(RecordsPush(records=raws(_record(n) for n in range(args.records))))
    before_decoder = msgspec.json.Decoder(_Before)

    def before() -> float:
        start = time.perf_counter()
        for _ in range(args.pushes):
            push = before_decoder.decode(body)
            covered = [signed_bytes(r) for r in push.records]
        assert len(covered) == args.records
        return float(args.pushes / (time.perf_counter() - start))

    def now() -> float:
        start = time.perf_counter()
        for _ in range(args.pushes):
            push = push_decoder.decode(body)
            refused: list[str] = []
            kept: list[Any] = _decoded(push.records, NodeRecord, refused)
            covered = [signed_payload(k.raw, k.fact.signature) for k in kept]
        assert len(covered) == args.records
        assert None not in covered
        return float(args.pushes / (time.perf_counter() - start))

    print(f"a push of {args.records} records, {len(body):,} bytes")
    interleave(before, now, rounds=args.rounds, unit="pushes/s", label="records push")


if __name__ == "__main__":
    main()
