"""The workload API's bodies (`POST` / `PATCH /v1/workloads`), decoded and checked here so
every error names the field; no I/O.

A workload is an artifact plus a complete serving configuration (hashed into its `svg_`
digest, `plane.core.digest`), scale bounds, a priority class and placement constraints. Only
`service` is accepted: `task` and `gang` are reserved names (seed 000), refused as such.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

import msgspec
from msgspec import Meta, Struct

from plane.core.digest import serving_digest
from plane.core.errors import BadInput
from plane.http.answers import JsonBody, decoded_or_none

__all__ = [
    "MAX_REPLICAS",
    "Constraints",
    "Serving",
    "WorkloadCreate",
    "WorkloadPatch",
    "decode_create",
    "decode_patch",
    "digest_of",
]

MAX_REPLICAS: Final = 1024  # DesiredDeployment.replicas' bound
RESERVED_KINDS: Final = ("task", "gang")

_Short = Annotated[str, Meta(max_length=128, pattern=r"^[^\x00]*$")]
_Arg = Annotated[str, Meta(max_length=4096, pattern=r"^[^\x00]*$")]
_Count = Annotated[int, Meta(ge=0, le=MAX_REPLICAS)]


class Serving(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How a replica serves: all of it goes into the serving digest."""

    engine: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[^\x00]*$")]
    source: _Arg = ""  # what the engine loads (default: the artifact's first location)
    args: Annotated[list[_Arg], Meta(max_length=256)] = []
    gpus: Annotated[int, Meta(ge=0, le=64)] = 1  # per replica
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    quantization: _Short = ""
    contextLength: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    maxInFlight: Annotated[int, Meta(ge=0, le=1_000_000)] = 0


class Constraints(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where the replicas may go."""

    deviceClass: Annotated[str, Meta(max_length=64, pattern=r"^[^\x00]*$")] = ""
    oneDomain: bool = False  # all GPUs of a replica in one topology domain
    minMemory: Annotated[int, Meta(ge=0, le=2**53)] = 0  # bytes each GPU must have
    regions: Annotated[list[_Short], Meta(max_length=64)] = []
    clusters: Annotated[list[_Short], Meta(max_length=1024)] = []  # ids or names


class WorkloadCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/workloads`."""

    name: str
    project: _Short  # prj_ id, or the project's name in the tenant
    artifact: _Short  # art_ id
    kind: _Short = "service"
    serving: Serving
    replicas: _Count = 1
    minReplicas: _Count | None = None  # default: min(1, replicas)
    maxReplicas: _Count | None = None  # default: replicas
    priorityClass: _Short | None = None  # a name or a prc_ id
    constraints: Constraints = Constraints()
    # Its count follows its load in each cluster (issue 30): the plane places maxReplicas
    # (`replicas` is then max) and each cluster scales its share between its part of min and it.
    onLoad: bool = False


class WorkloadPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/workloads/{id}`: what may change without a new workload."""

    replicas: _Count | None = None
    minReplicas: _Count | None = None
    maxReplicas: _Count | None = None
    paused: bool | None = None
    priorityClass: _Short | None = None
    onLoad: bool | None = None


_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")  # workloads.name's CHECK
_UNKNOWN: Final = re.compile(r"^Object contains unknown field `([^`]{0,64})`")


def _field_first(text: str) -> str:
    """msgspec's "... - at `$.serving.gpus`", led by the field: "serving.gpus: ..."."""
    message, at, where = text.rpartition(" - at `$.")
    if not at:
        message, where = text, ""
    where = where.rstrip("`")
    unknown = _UNKNOWN.match(message)
    if unknown is not None:  # the field is the unknown one itself
        where = f"{where}.{unknown[1]}" if where else unknown[1]
        message = "not a field this object has (docs/placement.md)"
    return f"{where}: {message}" if where else message


_MALFORMED: Final = "the body is a JSON object (docs/placement.md)"
_CREATE: Final = JsonBody(WorkloadCreate, invalid=_field_first, malformed=_MALFORMED)
_PATCH: Final = JsonBody(WorkloadPatch, invalid=_field_first, malformed=_MALFORMED)
_ANY_OBJECT: Final = msgspec.json.Decoder(dict[str, Any])


def decode_create(body: bytes) -> WorkloadCreate:
    """The checked create body; a 400 (`BodyRefused`, `BadInput`) naming the field otherwise."""
    if b'"kind"' in body:  # refuse the reserved kinds by name, before anything else
        peek = decoded_or_none(_ANY_OBJECT, body)
        kind = None if peek is None else peek.get("kind")
        if kind in RESERVED_KINDS:
            raise BadInput(f"kind: {kind!r} is reserved; only 'service' is accepted")
    asked = _CREATE.decode(body)
    if asked.kind != "service":
        raise BadInput(f"kind: {asked.kind[:32]!r} is not a workload kind; only 'service'")
    if not _NAME.match(asked.name):
        raise BadInput(
            "name: 1 to 128 of A-Z a-z 0-9 . _ : / - (not starting with . _ : / -), the model "
            "name its deployments serve"
        )
    s, c = asked.serving, asked.constraints
    if s.gpus > 0 and not c.deviceClass:
        raise BadInput(
            "constraints.deviceClass: required when serving.gpus > 0 (quotas count by class)"
        )
    if s.gpus > 0 and s.tp > s.gpus:
        raise BadInput(f"serving.tp: {s.tp} is more than serving.gpus ({s.gpus})")
    low = asked.minReplicas if asked.minReplicas is not None else min(1, asked.replicas)
    high = asked.maxReplicas if asked.maxReplicas is not None else max(asked.replicas, low)
    if asked.onLoad:  # placed at its max; each cluster's count follows the load below it
        check_scale(high, low, high)
        if high == 0:
            raise BadInput("maxReplicas: a workload on load needs a max of 1 or more")
        return msgspec.structs.replace(asked, minReplicas=low, maxReplicas=high, replicas=high)
    check_scale(asked.replicas, low, high)
    return msgspec.structs.replace(asked, minReplicas=low, maxReplicas=high)


def decode_patch(body: bytes) -> WorkloadPatch:
    """The checked patch body; a 400 (`BodyRefused`) naming the field otherwise."""
    return _PATCH.decode(body)


def check_scale(replicas: int, low: int, high: int) -> None:
    """`BadInput` naming the field unless minReplicas <= replicas <= maxReplicas."""
    if low > high:
        raise BadInput(f"minReplicas: {low} is more than maxReplicas ({high})")
    if not low <= replicas <= high:
        raise BadInput(f"replicas: {replicas} is outside minReplicas..maxReplicas ({low}..{high})")


def digest_of(serving: Serving) -> tuple[dict[str, Any], str]:
    """The serving configuration as stored (every field, defaults too) and its digest."""
    stored: dict[str, Any] = msgspec.to_builtins(serving)
    for name in Serving.__struct_fields__:
        stored.setdefault(name, getattr(serving, name))
    return stored, serving_digest(stored)
