"""Placing a new engine: device class, memory, one topology domain, tight fits first."""

from __future__ import annotations

from scheduler import DeviceView, NodeView, PlacementRequest, rank_placement

GIB = 1024**3


def devices(cls: str, n: int, *, free: int, domains: int = 1) -> tuple[DeviceView, ...]:
    return tuple(
        DeviceView(free * GIB, 80 * GIB, 0.0, True, f"d{i * domains // n}", cls) for i in range(n)
    )


def test_class_memory_and_domain() -> None:
    nodes = [
        NodeView("a", devices=devices("h100-80gb-sxm", 8, free=70)),
        NodeView("b", devices=devices("l4", 2, free=20)),
        NodeView("c", devices=devices("h100-80gb-sxm", 8, free=70, domains=2)),
        NodeView("d", devices=devices("h100-80gb-sxm", 8, free=10)),
        NodeView("e", cordoned=True, devices=devices("h100-80gb-sxm", 8, free=70)),
    ]
    placement = rank_placement(
        PlacementRequest(gpus=8, memory_bytes=40 * GIB, device_class="h100-80gb-sxm"), nodes
    )
    assert placement.best == ("a", "d0")
    assert dict(placement.refused) == {
        "b": "no healthy h100-80gb-sxm GPU",
        "c": "no topology domain with 8 GPU(s) of 40.0 GiB free",
        "d": "no topology domain with 8 GPU(s) of 40.0 GiB free",
        "e": "cordoned",
    }
    four = rank_placement(PlacementRequest(gpus=4, memory_bytes=40 * GIB), nodes)
    assert [n for n, _, _ in four.ranked] == ["a", "c"]


def test_tighter_fit_first() -> None:
    nodes = [
        NodeView("roomy", devices=devices("l40s", 4, free=46)),
        NodeView("tight", devices=devices("l40s", 4, free=22)),
    ]
    assert rank_placement(PlacementRequest(gpus=2, memory_bytes=20 * GIB), nodes).best == (
        "tight",
        "d0",
    )
