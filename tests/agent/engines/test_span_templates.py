"""Multi-node command lines of the built-in templates (issue 32), checked against each
engine's own `--help` text kept as test data (`data/`: vLLM 0.34.0's `vllm serve
--help=all`, SGLang 0.5.23's `python -m sglang.launch_server --help`, each read from the
release's wheel): every flag a head or a worker part passes is one the engine has, and the
values are the rendezvous the records give (`agent.engines.parts`). An engine whose own
traffic crosses the network waits until the operator says the network is trusted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.engines.parts import UNTRUSTED, Waiting, part_values
from agent.engines.templates import (
    BUILTIN_TEMPLATES,
    LaunchSpec,
    for_part,
    render,
)
from agent.engines.tunnel import Tunnels
from facts.records import NodeRecord, Part, Replica
from tests.fixtures.records import node_record

DATA = Path(__file__).parent / "data"
_OPTION = re.compile(r"^  (-[^ ].*)$")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def flags_of(help_file: str) -> set[str]:
    """The flags of the option lines of a kept `--help` text (`  --flag X, -f X`)."""
    found: set[str] = set()
    for line in (DATA / help_file).read_text().splitlines():
        if match := _OPTION.match(line):
            found.update(_FLAG.findall(match.group(1)))
    return found


def spec(rank: int, **values: str | int) -> LaunchSpec:
    return LaunchSpec(
        replica_id=f"rep_part{rank}", kind="x", model="/models/llama-405b", served="big",
        tp=8, gpu_uuids=tuple(f"GPU-{i}" for i in range(8)), port=18000 + rank,
        rank=rank, nodes=2, **values,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("engine", "help_file"),
    [("vllm", "vllm-serve-help.txt"), ("sglang", "sglang-launch-server-help.txt")],
)
def test_head_and_worker_command_lines_use_only_the_engines_flags(
    engine: str, help_file: str
) -> None:
    known = flags_of(help_file)
    assert {"--nnodes", "--node-rank", "--host", "--port"} <= known  # the data was read
    template = BUILTIN_TEMPLATES[engine]
    head_spec = spec(0, head_addr="10.0.0.1")
    worker_spec = spec(1, head_addr="10.0.0.1", dist_port=18001)
    head, _ = render(for_part(template, head_spec), head_spec)
    worker, _ = render(for_part(template, worker_spec), worker_spec)
    for argv in (head, worker):
        used = [a for a in argv if a.startswith("-") and a not in ("-m",)]
        assert [f for f in used if f not in known] == [], argv
        assert argv[argv.index("--nnodes") + 1] == "2"
    assert head[head.index("--node-rank") + 1] == "0"
    assert worker[worker.index("--node-rank") + 1] == "1"
    if engine == "sglang":
        # One tensor-parallel group over both members' 8 GPUs; rank 0's init address.
        assert head[len(head) - 1 - head[::-1].index("--tp-size") + 1] == "16"
        assert head[head.index("--dist-init-addr") + 1] == "10.0.0.1:18001"  # its port + 1
        assert worker[worker.index("--dist-init-addr") + 1] == "10.0.0.1:18001"
    else:
        # A pipeline stage per member, tensor-parallel within; the workers headless.
        assert head[head.index("--pipeline-parallel-size") + 1] == "2"
        assert (head[head.index("--master-addr") + 1], head[head.index("--master-port") + 1]) == (
            "10.0.0.1",
            "18001",
        )
        assert worker[worker.index("--master-port") + 1] == "18001"
        assert "--headless" in worker
        assert "--headless" not in head
        assert worker[worker.index("--tensor-parallel-size") + 1] == "8"


def test_a_template_that_cannot_span_has_no_parts() -> None:
    from agent.engines.templates import TemplateError

    with pytest.raises(TemplateError, match="cannot span"):
        for_part(BUILTIN_TEMPLATES["ollama"], spec(1))
    assert for_part(BUILTIN_TEMPLATES["ollama"], LaunchSpec(
        replica_id="rep_x", kind="ollama", model="m", served="m",
    )) is BUILTIN_TEMPLATES["ollama"]  # fmt: skip


def records_with_head(port: int) -> list[NodeRecord]:
    layout = [Part(node="nod_a", devices=["a0"]), Part(node="nod_b", devices=["b0"])]
    head = Replica(
        id="rep_" + "h" * 26, deployment="big", deploymentId="dep_x", spec="s", port=port,
        group="grp_" + "g" * 26, layout=layout,
    )  # fmt: skip
    return [
        node_record("nod_a", replicas=[head], addresses=("10.0.0.1",)),
        node_record("nod_b", addresses=("10.0.0.2",)),
    ]


@pytest.mark.asyncio
async def test_network_engines_wait_for_a_trusted_network_then_for_their_head() -> None:
    layout = [("nod_a", ["a0"]), ("nod_b", ["b0"])]
    group = "grp_" + "g" * 26
    tunnels = Tunnels(lambda member, replica: None, lambda caller, replica: "no")  # type: ignore[arg-type, return-value]
    template = BUILTIN_TEMPLATES["sglang"]
    records = records_with_head(18000)
    assert await part_values("rep_w", group, layout, 1, template, records, tunnels) == Waiting(
        UNTRUSTED
    )
    worker = await part_values("rep_w", group, layout, 1, template, records, tunnels, trusted=True)
    assert worker == {"rank": 1, "nodes": 2, "head_addr": "10.0.0.1", "dist_port": 18001}
    # Before the head's engine has a port, the worker waits for it.
    waiting = await part_values(
        "rep_w", group, layout, 1, template, records_with_head(0), tunnels, trusted=True
    )
    assert isinstance(waiting, Waiting)
    assert "waiting for its head" in waiting.why
    head = await part_values("rep_h", group, layout, 0, template, records, tunnels, trusted=True)
    assert head == {"rank": 0, "nodes": 2, "head_addr": "10.0.0.1"}  # starts at once
