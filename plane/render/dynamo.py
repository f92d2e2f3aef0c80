"""A deployment rendered as an NVIDIA Dynamo `DynamoGraphDeployment` (seed 000: the operator
of a cluster that runs Kubernetes and Dynamo renders each deployment into one). Sans-I/O.

`render()` takes a `RenderInput` -- the little rendering needs of a deployment -- and returns
the object as plain dicts and lists (`nvidia.com/v1alpha1`, what `kubectl apply` takes as
JSON or YAML): an aggregated graph of two services, a `Frontend` (Dynamo's OpenAI-compatible
HTTP server, which discovers the workers of its graph) and one worker service for the engine
kind, `VllmWorker` (`python3 -m dynamo.vllm`) or `SglangWorker` (`python3 -m dynamo.sglang`),
with the deployment's replicas, GPUs per replica as its GPU limit, the tensor-parallel size,
the model and the served name on its command line and the deployment's extra arguments after
them, as the agent's own templates append them (`agent.engines.templates`). The command line is an
argv (`command` + `args`), never a shell string, so an argument cannot become shell syntax.

What a Kubernetes cluster decides for itself is left out: node choice (`constraints`), the
facade's request limit (`maxInFlight`), engine API keys (`engineKey`); docs/plane.md lists it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Final

from facts.deployments import Deployment
from plane.desired.state import DesiredDeployment

__all__ = [
    "API_VERSION",
    "DEFAULT_TAG",
    "KIND",
    "DynamoSettings",
    "RenderInput",
    "RenderRefused",
    "render",
    "resource_name",
]

API_VERSION: Final = "nvidia.com/v1alpha1"
KIND: Final = "DynamoGraphDeployment"
DEFAULT_TAG: Final = "0.8.0"  # a Dynamo release whose examples use this v1alpha1 shape
MAX_NAME: Final = 45  # the operator names children `<graph>-<service>-…`: 63 at most each
FRONTEND: Final = "Frontend"
FRONTEND_PORT: Final = 8000  # the port the operator's frontend Service targets

_DNS_LABEL: Final = re.compile(r"[a-z]([a-z0-9-]*[a-z0-9])?")


class RenderRefused(ValueError):
    """A deployment Dynamo cannot run as declared; the message names the field and why."""


@dataclass(frozen=True, slots=True)
class _Worker:
    service: str
    module: str  # python3 -m MODULE
    model_flag: str
    tp_flag: str


# The engine kinds Dynamo has a worker for, and how each worker takes its model and TP size
# (the flags of `dynamo.vllm` -- vLLM's own -- and of `dynamo.sglang`, SGLang's own).
_WORKERS: Final = {
    "vllm": _Worker("VllmWorker", "dynamo.vllm", "--model", "--tensor-parallel-size"),
    "sglang": _Worker("SglangWorker", "dynamo.sglang", "--model-path", "--tp"),
}


@dataclass(frozen=True, slots=True)
class DynamoSettings:
    """The images the services run (Dynamo's public runtime images by default: each holds
    the frontend and its engine's worker) and the frontend's `componentType` ("frontend";
    operators from before its rename call it "main", the reference CRD's own example)."""

    vllm_image: str = f"nvcr.io/nvidia/ai-dynamo/vllm-runtime:{DEFAULT_TAG}"
    sglang_image: str = f"nvcr.io/nvidia/ai-dynamo/sglang-runtime:{DEFAULT_TAG}"
    frontend_type: str = "frontend"

    def image_for(self, engine: str) -> str:
        """The runtime image for an engine kind Dynamo has a worker for."""
        return self.vllm_image if engine == "vllm" else self.sglang_image


@dataclass(frozen=True, slots=True)
class RenderInput:
    """What rendering needs of a deployment: built by `from_deployment` from a cluster's
    `Deployment` or from one of the plane's per-cluster deployments (with that cluster's
    share as `replicas`)."""

    name: str  # the model name clients use
    deployment_id: str
    engine: str
    model: str  # what the engine loads: a path or a model id
    args: tuple[str, ...] = ()
    gpus: int = 1  # per replica
    tp: int = 1
    replicas: int = 1
    authority: str = "managed"

    @classmethod
    def from_deployment(cls, deployment: Deployment | DesiredDeployment) -> RenderInput:
        """The rendering input of a cluster's deployment, or of a plane deployment as its
        cluster receives it (a paused one at 0 replicas, as the cluster runs it); its model
        is `source`, else its name, as the agent launches it."""
        return cls(
            name=deployment.name,
            deployment_id=deployment.id,
            engine=deployment.engine,
            model=deployment.source or deployment.name,
            args=tuple(deployment.args),
            gpus=deployment.gpus,
            tp=deployment.tp,
            replicas=deployment.replicas,
            authority=deployment.authority,
        )


def resource_name(name: str) -> str:
    """A Kubernetes name for the deployment `name`: `name` itself when it is already a
    DNS-1035 label of at most `MAX_NAME` characters, else its lower-cased slug shortened and
    followed by 8 hex digits of its SHA-256, so two names never map to one object."""
    if len(name) <= MAX_NAME and _DNS_LABEL.fullmatch(name):
        return name
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not slug[:1].isalpha():
        slug = f"d-{slug}".rstrip("-")  # a Service name starts with a letter
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{slug[: MAX_NAME - 9].rstrip('-')}-{digest}"


def render(
    source: RenderInput, settings: DynamoSettings | None = None, *, image: str = ""
) -> dict[str, Any]:
    """The `DynamoGraphDeployment` for `source`; `image` (when given) replaces the runtime
    image of both services. `RenderRefused` for a kind Dynamo has no worker for, an
    `observed` deployment (the plane only records those: seed 000) or one without a GPU."""
    settings = settings or DynamoSettings()
    worker = _WORKERS.get(source.engine)
    if worker is None:
        known = " and ".join(sorted(_WORKERS))
        raise RenderRefused(
            f"engine {source.engine!r}: Dynamo has a worker for {known} only; "
            f"deployment {source.name!r} cannot be rendered for it"
        )
    if source.authority != "managed":
        raise RenderRefused(
            f"deployment {source.name!r} is {source.authority}: an observed engine is recorded "
            "and watched, never rendered (only managed deployments are)"
        )
    if source.gpus < 1:
        raise RenderRefused(f"deployment {source.name!r}: gpus 0, and a Dynamo worker needs one")
    name = resource_name(source.name)
    runs = image or settings.image_for(source.engine)
    worker_args = [
        worker.model_flag,
        source.model,
        "--served-model-name",
        source.name,
        worker.tp_flag,
        str(source.tp),
        *source.args,
    ]
    frontend = {
        "componentType": settings.frontend_type,
        "dynamoNamespace": name,
        "replicas": 1 if source.replicas else 0,  # scaled to zero: nothing serves
        "extraPodSpec": {
            "mainContainer": {
                "image": runs,
                "command": ["python3", "-m", "dynamo.frontend"],
                "args": ["--http-port", str(FRONTEND_PORT)],
            }
        },
    }
    engine = {
        "componentType": "worker",
        "dynamoNamespace": name,
        "replicas": source.replicas,
        "resources": {
            "requests": {"gpu": str(source.gpus)},
            "limits": {"gpu": str(source.gpus)},
        },
        "extraPodSpec": {
            "mainContainer": {
                "image": runs,
                "command": ["python3", "-m", worker.module],
                "args": worker_args,
            }
        },
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "labels": {
                "app.kubernetes.io/managed-by": "nvpair",
                "nvpair.io/deployment-id": source.deployment_id,
            },
            # The name clients use may hold what a label value cannot (`/`, `:`).
            "annotations": {"nvpair.io/deployment": source.name},
        },
        "spec": {
            "backendFramework": source.engine,
            "services": {FRONTEND: frontend, worker.service: engine},
        },
    }
