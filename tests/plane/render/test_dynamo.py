"""Rendering deployments as Dynamo `DynamoGraphDeployment`s (plane.render.dynamo,
plane.render.yaml_text, `nvpair plane render`): every rendered object validates against the real
CRD's `openAPIV3Schema` (../shared/reference/dynamo/, loaded once for the module)."""

from __future__ import annotations

import asyncio
import copy
import gzip
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import pytest_asyncio
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agent.cli.calls import CliError
from agent.cli.render import render_text
from plane.render.dynamo import (
    MAX_NAME,
    DynamoSettings,
    RenderInput,
    RenderRefused,
    render,
    resource_name,
)
from plane.render.yaml_text import dump
from tests.agent.harness import Node, make_node, start_cluster

from .. import demand_rows
from ..plane_client import Plane, enrol

# Dynamo's CRD, verbatim, gzipped (tests/fixtures/dynamo/README.md says where it is from).
CRD = (
    Path(__file__).resolve().parents[2]
    / "fixtures/dynamo"
    / "nvidia.com_dynamographdeployments.yaml.gz"
)
DEP_ID = "dep_01jd5x3z7k8m9n0p1q2r3s4t5v"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    """The CRD's v1alpha1 `openAPIV3Schema` (773 KB of YAML: read once per module)."""
    given = os.environ.get("NVPAIR_DYNAMO_CRD")
    text = Path(given).read_text() if given else gzip.decompress(CRD.read_bytes()).decode()
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    found: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return found


def check(schema: dict[str, Any], rendered: dict[str, Any]) -> None:
    """What the API server would check: the CRD schema, no field it would prune silently
    (its schemas are structural: an unknown field is dropped, not refused), and the
    object's name and labels (metadata is the server's own)."""
    jsonschema.Draft202012Validator(schema).validate(rendered)
    assert unknown_fields(rendered["spec"], schema["properties"]["spec"], "spec") == []
    metadata = rendered["metadata"]
    assert DNS_1035.fullmatch(metadata["name"])
    assert len(metadata["name"]) <= MAX_NAME
    assert all(LABEL_VALUE.fullmatch(v) and len(v) <= 63 for v in metadata["labels"].values())


def unknown_fields(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """The paths in `value` that `schema` does not declare."""
    if isinstance(value, list):
        return [
            p for i, item in enumerate(value) for p in unknown_fields(item, schema["items"], where)
        ]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    for key, item in value.items():
        if key in schema.get("properties", {}):
            found += unknown_fields(item, schema["properties"][key], f"{where}.{key}")
        elif isinstance(schema.get("additionalProperties"), dict):
            found += unknown_fields(item, schema["additionalProperties"], f"{where}.{key}")
        else:
            found.append(f"{where}.{key}")
    return found


def source(**changes: Any) -> RenderInput:
    base: dict[str, Any] = {
        "name": "llama",
        "deployment_id": DEP_ID,
        "engine": "vllm",
        "model": "/models/llama-3.1-8b",
    }
    return RenderInput(**(base | changes))


def worker(rendered: dict[str, Any]) -> dict[str, Any]:
    (name,) = [n for n in rendered["spec"]["services"] if n != "Frontend"]
    found: dict[str, Any] = rendered["spec"]["services"][name]
    return found


VARIANTS = {
    "vllm-tp1": source(),
    "vllm-tp4": source(gpus=4, tp=4, replicas=3),
    "sglang-tp1": source(engine="sglang"),
    "sglang-tp4": source(engine="sglang", gpus=4, tp=4, replicas=2),
    "extra-args": source(args=("--max-model-len", "8192", "--enforce-eager", "--x=a b;$(c)")),
    "long-odd-name": source(name="Meta/Llama-3.1-405B-Instruct:fp8_" + "x" * 200),
    "scaled-to-zero": source(replicas=0),
    "digit-first": source(name="7b.chat", engine="sglang"),
}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_rendered_objects_validate_against_the_crd(
    schema: dict[str, Any], variant: RenderInput
) -> None:
    rendered = render(variant)
    check(schema, rendered)
    assert rendered["apiVersion"] == "nvidia.com/v1alpha1"
    assert rendered["kind"] == "DynamoGraphDeployment"
    assert rendered["spec"]["backendFramework"] == variant.engine
    w = worker(rendered)
    assert w["componentType"] == "worker"
    assert w["replicas"] == variant.replicas
    assert w["resources"]["limits"]["gpu"] == str(variant.gpus)
    container = w["extraPodSpec"]["mainContainer"]
    assert container["command"] == ["python3", "-m", f"dynamo.{variant.engine}"]
    assert container["image"].startswith(f"nvcr.io/nvidia/ai-dynamo/{variant.engine}-runtime:")
    args = container["args"]
    tp_flag = "--tensor-parallel-size" if variant.engine == "vllm" else "--tp"
    model_flag = "--model" if variant.engine == "vllm" else "--model-path"
    assert args[args.index(tp_flag) + 1] == str(variant.tp)
    assert args[args.index(model_flag) + 1] == variant.model
    assert args[args.index("--served-model-name") + 1] == variant.name
    assert tuple(args[-len(variant.args) :] if variant.args else ()) == variant.args
    assert rendered["metadata"]["annotations"]["nvpair.io/deployment"] == variant.name
    frontend = rendered["spec"]["services"]["Frontend"]
    assert frontend["replicas"] == (1 if variant.replicas else 0)
    assert yaml.safe_load(dump(rendered)) == rendered  # the YAML the command prints


def test_an_image_and_frontend_type_given_are_used(schema: dict[str, Any]) -> None:
    settings = DynamoSettings(frontend_type="main")
    rendered = render(source(engine="sglang"), settings, image="registry.local/dynamo:dev")
    check(schema, rendered)
    services = rendered["spec"]["services"]
    assert {s["extraPodSpec"]["mainContainer"]["image"] for s in services.values()} == {
        "registry.local/dynamo:dev"
    }
    assert services["Frontend"]["componentType"] == "main"


@pytest.mark.parametrize("kind", ["llamacpp", "ollama", "mock", "tgi"])
def test_a_kind_dynamo_has_no_worker_for_is_refused(kind: str) -> None:
    with pytest.raises(RenderRefused, match=f"engine '{kind}': Dynamo has a worker for sglang"):
        render(source(engine=kind))


def test_observed_and_gpu_less_deployments_are_refused() -> None:
    with pytest.raises(RenderRefused, match="observed engine is recorded"):
        render(source(authority="observed"))
    with pytest.raises(RenderRefused, match="gpus 0"):
        render(source(gpus=0))


def test_the_validator_refuses_a_wrong_object(schema: dict[str, Any]) -> None:
    """The control: the checks above can fail."""
    rendered = render(source())
    check(schema, rendered)
    wrong_replicas = copy.deepcopy(rendered)
    worker(wrong_replicas)["replicas"] = "2"
    with pytest.raises(jsonschema.ValidationError, match="'2' is not of type 'integer'"):
        check(schema, wrong_replicas)
    wrong_framework = copy.deepcopy(rendered)
    wrong_framework["spec"]["backendFramework"] = "llamacpp"
    with pytest.raises(jsonschema.ValidationError, match="is not one of"):
        check(schema, wrong_framework)
    pruned = copy.deepcopy(rendered)
    worker(pruned)["gpus"] = 4
    with pytest.raises(AssertionError):
        check(schema, pruned)


@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_resource_names_are_dns_labels_and_keep_names_apart(name: str, other: str) -> None:
    made = resource_name(name)
    assert DNS_1035.fullmatch(made)
    assert len(made) <= MAX_NAME
    assert resource_name(name) == made
    assert (resource_name(other) == made) == (other == name)


def test_valid_names_are_kept() -> None:
    assert resource_name("llama") == "llama"
    assert resource_name("qwen3-0-6b") == "qwen3-0-6b"
    assert resource_name("Qwen/Qwen3-0.6B").startswith("qwen-qwen3-0-6b-")


_scalars = st.none() | st.booleans() | st.integers() | st.text()
_data = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_data)
def test_yaml_text_reads_back_as_written(value: Any) -> None:
    assert yaml.safe_load(dump(value)) == value


def test_yaml_text_keeps_lookalike_strings_strings() -> None:
    tricky = {"yes": "no", "on": ["null", "~", "1e3", "0x10", "2026-12-01", "a: b", "- c"]}
    assert yaml.safe_load(dump(tricky)) == tricky
    # Keys past YAML's 1,024-character simple-key limit (as written: escapes count).
    long = {"k" * 1500: {"x": [1, {"\u0100" * 300: None}]}, "short": 1}
    assert yaml.safe_load(dump(long)) == long
    with pytest.raises(TypeError):
        dump({"x": 1.5})


def test_the_command_formats_a_listed_deployment() -> None:
    view = {"id": DEP_ID, "name": "llama", "engine": "vllm", "gpus": 2, "tp": 2}
    views = [view | {"replicaStates": {"ready": 1}}]
    text = render_text(views, "llama", "dynamo-json", image="x/y:z")
    assert json.loads(text) == render(source(gpus=2, tp=2, model="llama"), image="x/y:z")
    with pytest.raises(CliError, match="no deployment 'other'"):
        render_text(views, "other", "dynamo")
    with pytest.raises(CliError, match="engine 'ollama'"):
        render_text([view | {"engine": "ollama"}], "llama", "dynamo")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def agent(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    node = make_node(tmp_path_factory.mktemp("render"), "a", None)
    node.home.mkdir(parents=True)
    async for (started,) in start_cluster([node]):
        yield started


@pytest.mark.asyncio(loop_scope="module")
async def test_render_through_a_real_agent(agent: Node, schema: dict[str, Any]) -> None:
    """A deployment declared at an agent renders from its `GET /v1/deployments`. The node
    has no GPU, so the 4-GPU replicas are never placed and no vLLM is launched."""
    code, _, err = await agent.cli(
        "deploy", "Qwen/Qwen3-0.6B", "--engine", "vllm", "--model", "Qwen/Qwen3-0.6B",
        "--gpus", "4", "--replicas", "2", "--", "--max-model-len", "4096",
    )  # fmt: skip
    assert code == 0, err
    code, out, err = await agent.cli("plane", "render", "Qwen/Qwen3-0.6B", "--format", "dynamo")
    assert code == 0, err
    rendered = yaml.safe_load(out)
    check(schema, rendered)
    args = worker(rendered)["extraPodSpec"]["mainContainer"]["args"]
    assert args[-2:] == ["--max-model-len", "4096"]
    assert worker(rendered)["replicas"] == 2
    code, out, err = await agent.cli("plane", "render", "nope", "--format", "dynamo")
    assert (code, out) == (1, "")
    assert "no deployment 'nope'" in err


async def test_the_plane_renders_its_own_deployments(plane: Plane, schema: dict[str, Any]) -> None:
    """A plane deployment (a workload's share on one cluster) renders as its cluster receives
    it, vLLM at TP 4 and SGLang at TP 1, valid against the CRD; through the API and through
    `nvpair plane render --plane`. Another tenant's is a 404, a cluster token a 403."""
    east, east_token = await enrol(plane, "east")
    async with plane.store.pool.connection() as conn:
        _, prj, key = await demand_rows.tenant(conn, "acme")
        _, _, other_key = await demand_rows.tenant(conn, "globex")
        shapes = {
            "big": {"engine": "vllm", "gpus": 4, "tp": 4, "args": ["--max-model-len", "8192"]},
            "small": {"engine": "sglang", "gpus": 1, "tp": 1},
        }
        ids = {}
        for name, serving in shapes.items():
            wkl = await demand_rows.workload(conn, prj, name, serving=serving, source="/w/" + name)
            ids[name] = await demand_rows.deployment(conn, wkl, east, 3)
    for name, (engine, tp) in {"big": ("vllm", 4), "small": ("sglang", 1)}.items():
        status, rendered = await plane.call(
            "GET", f"/v1/deployments/{ids[name]}/dynamo?format=json", key
        )
        assert status == 200, rendered
        check(schema, rendered)
        service = worker(rendered)
        assert service["replicas"] == 3  # that cluster's share
        assert service["resources"]["limits"]["gpu"] == str(tp)
        assert engine in json.dumps(service["extraPodSpec"]["mainContainer"]).lower()
    path = f"/v1/deployments/{ids['big']}/dynamo?format=json"
    assert (await plane.call("GET", path, other_key))[0] == 404  # another tenant's
    assert (await plane.call("GET", path, east_token))[0] == 403
    assert (await plane.call("GET", path.replace("format=json", "format=xml"), key))[0] == 400

    env = {**os.environ, "NVPAIR_PLANE_KEY": key}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "plane", "render", "big", "--plane", plane.url,
        "--format", "dynamo", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    check(schema, yaml.safe_load(out))
    assert yaml.safe_load(out) == (await plane.call("GET", path, key))[1]
