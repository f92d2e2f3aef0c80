"""GPU discovery through a fake pynvml, the real pynvml on this GPU-less machine, and
simulated GPUs."""

from __future__ import annotations

import sys

import pytest

from agent.engines.gpus import device_class, discover, parse_simulation, simulate, stable_id
from tests.fixtures.fake_pynvml import FakeGpu, fake_pynvml

NODE = "nod_01jd8x3c5v0q2k9m4t7w1y6z8a"


def eight_h100(**changes: object) -> list[FakeGpu]:
    gpus = [FakeGpu(uuid=f"GPU-{i}", bus=f"00000000:{0x18 + i:02x}:00.0") for i in range(8)]
    for gpu in gpus:
        for key, value in changes.items():
            setattr(gpu, key, value)
    return gpus


def test_healthy_devices_with_every_figure() -> None:
    inventory = discover(NODE, load=lambda: fake_pynvml(eight_h100()))
    assert inventory.reason is None
    assert inventory.driver == "550.54.15"
    assert len(inventory.devices) == 8
    first = inventory.devices[0]
    assert first.deviceClass == "h100-80gb-sxm"
    assert (first.memoryTotal, first.memoryUsed, first.memoryFree) == (
        85_520_809_984,
        1_000_000_000,
        84_520_809_984,
    )
    assert (first.utilization, first.temperatureC, first.powerW) == (7, 41, 120.0)
    assert first.health == "ok"
    assert first.id.startswith("dev_")


def test_ids_are_stable_across_discoveries() -> None:
    one = discover(NODE, load=lambda: fake_pynvml(eight_h100()))
    two = discover(NODE, load=lambda: fake_pynvml(eight_h100()))
    assert [d.id for d in one.devices] == [d.id for d in two.devices]
    assert [d.id for d in one.domains] == [d.id for d in two.domains]
    assert len({d.id for d in one.devices}) == 8
    assert stable_id("dev", NODE, "GPU-0") != stable_id("dev", "nod_other", "GPU-0")


def test_fabric_cliques_become_domains() -> None:
    gpus = eight_h100()
    for i, gpu in enumerate(gpus):
        gpu.fabric = (b"\x11" * 16, 1 if i < 4 else 2)
    inventory = discover(NODE, load=lambda: fake_pynvml(gpus))
    assert [(d.kind, len(d.devices)) for d in inventory.domains] == [
        ("nvlink-fabric", 4),
        ("nvlink-fabric", 4),
    ]
    assert inventory.devices[0].domainId == inventory.domains[0].id
    assert inventory.devices[7].domainId == inventory.domains[1].id


def test_nvlink_peer_groups_without_a_fabric() -> None:
    gpus = eight_h100()
    # two islands of four, each device linked to the next within its island
    for island in (range(4), range(4, 8)):
        for i in island:
            peers = [gpus[j].bus for j in island if j != i]
            gpus[i].nvlinks = peers
    inventory = discover(NODE, load=lambda: fake_pynvml(gpus))
    assert sorted((d.kind, len(d.devices)) for d in inventory.domains) == [
        ("nvlink", 4),
        ("nvlink", 4),
    ]


def test_pcie_numa_domains_without_nvlink() -> None:
    gpus = [
        FakeGpu(name="NVIDIA L4", uuid=f"GPU-{i}", total=24 * 1024**3, numa=i // 2, bus=f"0:{i}")
        for i in range(4)
    ]
    inventory = discover(NODE, load=lambda: fake_pynvml(gpus))
    assert [(d.kind, d.label, len(d.devices)) for d in inventory.domains] == [
        ("pcie", "numa 0", 2),
        ("pcie", "numa 1", 2),
    ]
    assert inventory.devices[0].deviceClass == "l4-24gb"


def test_missing_library_means_zero_devices_and_a_reason() -> None:
    inventory = discover(NODE, load=lambda: fake_pynvml([], library=False))
    assert inventory.devices == []
    assert inventory.reason is not None
    assert "NVMLError_LibraryNotFound" in inventory.reason


def test_no_gpu_means_zero_devices_and_a_reason() -> None:
    inventory = discover(NODE, load=lambda: fake_pynvml([]))
    assert inventory.devices == []
    assert inventory.reason == "NVML reports no GPU"


@pytest.mark.parametrize("broken", ["handle", "memory"])
def test_a_device_that_errors_is_failed_and_the_others_are_fine(broken: str) -> None:
    gpus = eight_h100()
    gpus[3].broken = broken
    inventory = discover(NODE, load=lambda: fake_pynvml(gpus))
    assert [d.health for d in inventory.devices] == ["ok"] * 3 + ["failed"] + ["ok"] * 4
    assert "GpuIsLost" in (inventory.devices[3].problem or "")


def test_ecc_errors_and_pending_retirement_are_degraded() -> None:
    gpus = eight_h100()
    gpus[1].ecc = 3
    gpus[2].pending_retire = True
    inventory = discover(NODE, load=lambda: fake_pynvml(gpus))
    assert [d.health for d in inventory.devices[:3]] == ["ok", "degraded", "degraded"]
    assert inventory.devices[1].problem == "3 uncorrected ECC errors"


def test_the_real_pynvml_on_a_machine_without_a_gpu() -> None:
    # This machine has nvidia-ml-py but no NVIDIA driver: zero devices, one clear reason.
    assert "pynvml" not in sys.modules or sys.modules["pynvml"].__file__ is not None
    inventory = discover(NODE)
    if inventory.devices:  # pragma: no cover - only on a machine with a GPU
        pytest.fail("this test expects a machine without a GPU")
    assert inventory.reason is not None
    assert "NVML unavailable" in inventory.reason


@pytest.mark.parametrize(
    ("name", "gib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 79.6, "h100-80gb-sxm"),
        ("NVIDIA H100 PCIe", 79.6, "h100-80gb-pcie"),
        ("NVIDIA H100 NVL", 93.6, "h100-94gb-nvl"),
        ("NVIDIA H200", 139.8, "h200-141gb"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb-sxm"),
        ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gb-pcie"),
        ("NVIDIA L4", 22.5, "l4-24gb"),
        ("NVIDIA GeForce RTX 4090", 23.6, "rtx4090-24gb"),
    ],
)
def test_device_classes(name: str, gib: float, expected: str) -> None:
    assert device_class(name, int(gib * 1024**3)) == expected


def test_simulation() -> None:
    inventory = simulate("h100-80gb-sxm:8,l4:2", NODE)
    assert inventory.simulated
    assert [d.deviceClass for d in inventory.devices] == ["h100-80gb-sxm"] * 8 + ["l4"] * 2
    assert [(d.kind, len(d.devices)) for d in inventory.domains] == [("nvlink", 8), ("pcie", 2)]
    assert inventory.devices[0].memoryTotal == 80 * 1024**3


@pytest.mark.parametrize("spec", ["h100:x", "H100:2", "l4:0", "l4:65", "bad class:1"])
def test_bad_simulation_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"CLASS|between"):
        parse_simulation(spec)
