"""bench/_scale_agents.py: its per-member-per-beat arithmetic, and one short run at three
agents that prints every line with its figures."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def agents_bench() -> ModuleType:
    # bench/ is a folder of scripts, not a package: its modules import each other by name.
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module("_scale_agents")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_heartbeat_bytes_are_per_member_per_beat(agents_bench: ModuleType) -> None:
    # Two node ports (21000, 21001); a connection from each to the other, both sockets
    # listed, and one socket of another port that does not count.
    before = (
        "0 0 127.0.0.1:40000 127.0.0.1:21000\n\t cubic bytes_sent:1000\n"
        "0 0 127.0.0.1:21000 127.0.0.1:40000\n\t cubic bytes_sent:500\n"
        "0 0 127.0.0.1:40001 127.0.0.1:21001\n\t cubic bytes_sent:0\n"
        "0 0 127.0.0.1:21001 127.0.0.1:40001\n\t cubic bytes_sent:0\n"
    )
    after = (
        "0 0 127.0.0.1:40000 127.0.0.1:21000\n\t cubic bytes_sent:3000\n"
        "0 0 127.0.0.1:21000 127.0.0.1:40000\n\t cubic bytes_sent:1500\n"
        "0 0 127.0.0.1:40001 127.0.0.1:21001\n\t cubic bytes_sent:2000\n"
        "0 0 127.0.0.1:21001 127.0.0.1:40001\n\t cubic bytes_sent:1000\n"
        "0 0 127.0.0.1:5432 127.0.0.1:41000\n\t cubic bytes_sent:999999\n"
    )
    ports = {21000, 21001}
    total = agents_bench.wire_delta(
        agents_bench.wire_bytes(before, ports), agents_bench.wire_bytes(after, ports)
    )
    assert total == 2000 + 1000 + 2000 + 1000
    # 6,000 B by 2 members over 3 beats: 1,000 B per member per beat.
    assert agents_bench.per_member_beat(total, 2, 3) == 1000.0
    assert agents_bench.per_member_beat(0, 16, 10) == 0.0
    with pytest.raises(ValueError, match="positive"):
        agents_bench.per_member_beat(total, 0, 3)
    with pytest.raises(ValueError, match="positive"):
        agents_bench.per_member_beat(total, 2, 0)
