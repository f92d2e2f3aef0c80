"""The operator's view of deployments (issue 13, item 7): `nvpair logs` on the node that runs
a replica (and a pointer to that node anywhere else), a failed replica's last log lines in
`nvpair replicas` there, and `nvpair explain` for a deployment's placement and for its
model's replica ranking -- three real agents on simulated GPUs, mock and custom engines."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from ..deploy_harness import engine_cluster, post, ready_everywhere, replicas
from ..harness import TIMEOUT, Node, eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

GPUS = {"big": "h100-80gb-sxm:8", "split": "h100-80gb-sxm:2,h100-80gb-sxm:2", "small": "l4:2"}
# An engine that loads for ever: what a model too large for its timeout looks like.
LOADING = (
    "import time; [print('Loading safetensors checkpoint shards: %d/4' % i, flush=True)"
    " for i in range(1, 5)]; time.sleep(3600)"
)
STUCK = f"""
[templates.stuck]
argv = [{json.dumps(sys.executable)}, "-c", "{LOADING}"]
ready = "/health"
ready_timeout_s = 2
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def trio(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[list[Node]]:
    async for started in engine_cluster(tmp_path_factory.mktemp("deploy-ops"), GPUS, STUCK):
        yield started


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def echo(trio: list[Node]) -> str:
    """One ready mock replica of `echo` on big, declared with `nvpair deploy` as the docs
    write it (flags after NAME, engine arguments after --); its id."""
    # By node id: the node's own view names itself by id only (see the report).
    big_id = await trio[0].node_id()
    code, out, err = await trio[1].cli(
        "deploy", "echo", "--model", "echo", "--engine", "mock", "--node", big_id,
        "--", "--latency-ms", "1",
    )  # fmt: skip
    assert code == 0, err
    assert "deployment echo (dep_" in out
    await eventually(lambda: ready_everywhere(trio, "echo", 1), "echo ready", within_s=60)

    async def held() -> list[dict[str, Any]]:
        return [d for d in await trio[2].get("/v1/deployments") if d["name"] == "echo"]

    async def holds() -> bool:
        return bool(await held())

    # The replica's record (from big) can reach the third member before the deployment does
    # (from the member it was declared on).
    await eventually(holds, "the third member holds echo")
    (declared,) = await held()
    assert declared["args"] == ["--latency-ms", "1"]
    assert declared["engine"] == "mock"
    (replica,) = await replicas(trio[0], "echo")
    return str(replica["id"])


async def test_logs_are_read_on_the_replicas_node_and_followed(trio: list[Node], echo: str) -> None:
    big, split, _ = trio
    code, out, err = await big.cli("logs", echo, "--tail", "5")
    assert code == 0, err
    assert "mock engine serving" in out
    # Elsewhere the log is not fetched: the answer names the node that has it.
    code, out, err = await split.cli("logs", echo)
    assert code == 1
    assert f"{echo} runs on big" in err
    assert "nvpair logs" in err
    # Only the owner of the local API reads it.
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{big.api}/v1/replicas/{echo}/log") as response,
    ):
        assert response.status == 401
        assert "mock engine serving" not in await response.text()
    # --follow prints what is written after it started.
    follow = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "logs", echo, "--follow", env=big.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert follow.stdout is not None
    try:
        await _line_with(follow.stdout, "mock engine serving")
        with (big.home / "replicas" / echo / "engine.log").open("ab") as log:
            log.write(b"a line written after --follow started\n")
        await _line_with(follow.stdout, "a line written after --follow started")
    finally:
        follow.send_signal(signal.SIGINT)
        # Read its output to the end while it stops: a child whose pipe nobody reads can
        # block on its last flush (seen twice in the suite: no exit within the bound).
        try:
            _, said = await asyncio.wait_for(follow.communicate(), TIMEOUT)
        except TimeoutError:
            follow.kill()
            _, said = await follow.communicate()
            raise AssertionError(
                f"logs --follow did not stop on SIGINT: {said[-2000:]!r}"
            ) from None
    assert follow.returncode == 0, said


async def test_a_replica_that_never_gets_ready_shows_its_last_log_lines(
    trio: list[Node],
) -> None:
    big, _, small = trio
    body = {"name": "stuck", "engine": "stuck", "constraints": {"node": await small.node_id()}}
    code, text = await post(big, "/v1/deployments", body)
    assert code == 201, text

    async def failed() -> bool:
        return "failed" in [r["state"] for r in await replicas(small, "stuck")]

    await eventually(failed, "a stuck replica failed on small", within_s=60)
    code, out, err = await small.cli("replicas")
    assert code == 0, err
    row = next(line for line in out.splitlines() if " stuck " in line and "failed" in line)
    assert "not ready within 2s" in row
    assert "    | Loading safetensors checkpoint shards: 4/4" in out
    # The lines are the owner's of that node: another member's view has no log in it.
    there = [r for r in await replicas(small, "stuck") if r["state"] == "failed"]
    assert all("Loading safetensors checkpoint shards: 4/4" in r["logTail"] for r in there)
    seen_elsewhere = await replicas(big, "stuck")
    assert seen_elsewhere
    assert all("logTail" not in r for r in seen_elsewhere)


async def test_explain_says_why_a_tp4_one_domain_replica_is_not_on_the_split_node(
    trio: list[Node],
) -> None:
    big, split, small = trio
    body = {"name": "tp4", "engine": "mock", "gpus": 4, "constraints": {"oneDomain": True}}
    code, text = await post(small, "/v1/deployments", body)
    assert code == 201, text
    await eventually(lambda: ready_everywhere(trio, "tp4", 1), "a ready tp4", within_s=60)
    code, out, err = await big.cli("explain", "--deployment", "tp4", "--node", "split")
    assert code == 0, err
    assert "no topology domain with 4 free GPUs (at most 2 in one)" in out
    assert "big" not in out  # only the member asked about
    code, out, err = await split.cli("explain", "--deployment", "tp4", "--json")
    assert code == 0, err
    verdicts = {row["node"]: row for row in json.loads(out)["nodes"]}
    assert set(verdicts) == {"big", "split", "small"}
    assert verdicts["big"]["replicas"] == 1
    assert "topology domain" in verdicts["split"]["reason"]
    assert verdicts["small"]["reason"].endswith("free healthy GPU(s), 4 needed")
    code, _, err = await big.cli("explain", "--deployment", "nothing-by-that-name")
    assert code == 1
    assert "no deployment named" in err


async def test_explain_model_ranks_a_deployments_replicas(trio: list[Node], echo: str) -> None:
    code, out, err = await trio[2].cli("explain", "echo")
    assert code == 0, err
    assert "echo is a deployment" in out
    (row,) = [line.split() for line in out.splitlines() if echo in line]
    assert row[:3] == ["1", echo, "big"]
    float(row[3])  # its score
    code, out, err = await trio[2].cli("explain", "echo", "--json")
    assert code == 0, err
    ranked = json.loads(out)["replicas"]["ranked"]
    assert [r["replica"] for r in ranked] == [echo]


async def _line_with(stream: asyncio.StreamReader, text: str) -> None:
    async def read() -> None:
        while text.encode() not in await stream.readline():
            if stream.at_eof():
                raise AssertionError(f"{text!r} never printed")

    await asyncio.wait_for(read(), TIMEOUT)
