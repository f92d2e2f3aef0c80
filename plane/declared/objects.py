"""The declared objects of the binding and supply sides as the plane API takes them (seed 000:
tenants, keys, projects, quotas, priority classes, policies, pools, artifacts, and the
attributes of a cluster that policies test). Placement evaluates the policies
(`plane.placement.capacity.Policy`).

Every request body is a `msgspec.Struct` that refuses unknown fields and bounds every string
and list, so a decode error already names the field (`... - at `$.host``). A PATCH body's
fields default to `UNSET`: only the fields it carries change. No psycopg here.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

__all__ = [
    "ARTIFACT_KINDS",
    "ArtifactCreate",
    "ClusterAttrsPatch",
    "KeyCreate",
    "PolicyCreate",
    "PolicyPatch",
    "PolicySpec",
    "PolicySpecPatch",
    "PoolCreate",
    "PoolPatch",
    "PoolSpec",
    "PoolSpecPatch",
    "PriorityClassCreate",
    "PriorityClassPatch",
    "ProjectCreate",
    "ProjectPatch",
    "QuotaCreate",
    "QuotaPatch",
    "TenantCreate",
    "TenantPatch",
]

ARTIFACT_KINDS: Final = ("base", "fine-tune", "quantized", "lora")
_ULID: Final = "[0-9a-hjkmnp-tv-z]{26}"

# A name: what `nvpair plane` commands and URLs carry without quoting.
Name = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
# Free text that PostgreSQL stores (no NUL).
Text = Annotated[str, Meta(max_length=1024, pattern=r"^[^\x00]*$")]
# A label such as a region or residency ("eu", "us-east-1").
Label = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")]
_LabelOrNone = Annotated[str, Meta(max_length=64, pattern=r"^([A-Za-z0-9][A-Za-z0-9._:/-]*)?$")]
# A DNS host name (RFC 1123 labels), compared case-insensitively.
Host = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$",
    ),
]
DeviceClass = Annotated[
    str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")
]  # h100-80gb-sxm, l4: what the nodes report
ClusterRef = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[^\x00]+$")]
Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
# A storage location: a URL with a scheme (s3://, https://, hf://, file://) or an absolute path.
Location = Annotated[
    str,
    Meta(min_length=1, max_length=2048, pattern=r"^([A-Za-z][A-Za-z0-9+.-]*://|/)[^\s\x00]*$"),
]
TenantId = Annotated[str, Meta(pattern=f"^ten_{_ULID}$")]
ProjectId = Annotated[str, Meta(pattern=f"^prj_{_ULID}$")]
ClusterId = Annotated[str, Meta(pattern=f"^clu_{_ULID}$")]
# What a policy attaches to: a tenant, endpoint, workload or cluster (seed 000).
AttachId = Annotated[str, Meta(pattern=f"^(ten|end|wkl|clu)_{_ULID}$")]
_Count = Annotated[int, Meta(ge=0, le=1_000_000)]
_Weight = Annotated[float, Meta(ge=0, le=1_000_000)]
_Cost = Annotated[float, Meta(ge=0, le=1_000_000)]
_Int32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


def _refuse(message: str) -> None:
    raise msgspec.ValidationError(message)


# -- tenants, keys, projects -----------------------------------------------------------------


class TenantCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/tenants`: an organisation and the host name its requests arrive on."""

    name: Name
    host: Host | None = None


class TenantPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/tenants/{id}`; `host: null` clears it."""

    name: Name | UnsetType = UNSET
    host: Host | UnsetType | None = UNSET


class KeyCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/tenants/{id}/keys`: an optional label for the key."""

    name: Annotated[str, Meta(max_length=128, pattern=r"^[^\x00]*$")] = ""


class ProjectCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/projects`; the admin names the tenant, a tenant key's tenant is its own."""

    name: Name
    tenantId: TenantId | None = None


class ProjectPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/projects/{id}`."""

    name: Name | UnsetType = UNSET


# -- quotas and priority classes --------------------------------------------------------------


class QuotaCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/quotas`: a device ceiling per project and device class, in one cluster or
    fleet-wide (no `clusterId`). `guaranteed` and `overQuotaWeight` are recorded only."""

    projectId: ProjectId
    deviceClass: DeviceClass
    clusterId: ClusterId | None = None
    maxDevices: _Count
    guaranteed: _Count = 0
    overQuotaWeight: _Weight = 0.0

    def __post_init__(self) -> None:
        check_floor(self.guaranteed, self.maxDevices)


class QuotaPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/quotas/{id}`: the numbers (project, class and scope are the quota's key)."""

    maxDevices: _Count | UnsetType = UNSET
    guaranteed: _Count | UnsetType = UNSET
    overQuotaWeight: _Weight | UnsetType = UNSET


def check_floor(guaranteed: int, max_devices: int) -> None:
    """A guaranteed floor above the ceiling is refused, naming the field."""
    if guaranteed > max_devices:
        _refuse(
            f"guaranteed ({guaranteed}) is above maxDevices ({max_devices}) - at `$.guaranteed`"
        )


class PriorityClassCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/priority-classes`: recorded, not acted on yet (seed 000)."""

    name: Name
    value: _Int32
    preemptible: bool = False
    description: Text = ""


class PriorityClassPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/priority-classes/{id}`."""

    name: Name | UnsetType = UNSET
    value: _Int32 | UnsetType = UNSET
    preemptible: bool | UnsetType = UNSET
    description: Text | UnsetType = UNSET


# -- policies ----------------------------------------------------------------------------------


class PolicySpec(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Placement constraints; an empty list or None constrains nothing. Clusters are named
    by id or by name."""

    regions: Annotated[list[Label], Meta(max_length=64)] = []
    residency: Label | None = None
    deviceClasses: Annotated[list[DeviceClass], Meta(max_length=64)] = []
    maxCostPerDeviceHour: _Cost | None = None
    allowClusters: Annotated[list[ClusterRef], Meta(max_length=1024)] = []
    denyClusters: Annotated[list[ClusterRef], Meta(max_length=1024)] = []


class PolicySpecPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A PATCH of a policy's spec: the fields given replace the stored ones."""

    regions: Annotated[list[Label], Meta(max_length=64)] | UnsetType = UNSET
    residency: Label | UnsetType | None = UNSET
    deviceClasses: Annotated[list[DeviceClass], Meta(max_length=64)] | UnsetType = UNSET
    maxCostPerDeviceHour: _Cost | UnsetType | None = UNSET
    allowClusters: Annotated[list[ClusterRef], Meta(max_length=1024)] | UnsetType = UNSET
    denyClusters: Annotated[list[ClusterRef], Meta(max_length=1024)] | UnsetType = UNSET


class PolicyCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/policies`: a spec attached to a tenant, endpoint, workload or cluster. A
    tenant key's policy is its tenant's; the admin's is the admin's (no tenant may see or
    change it), or, with `tenantId`, that tenant's."""

    name: Annotated[str, Meta(max_length=128, pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]*)?$")] = ""
    attachedTo: AttachId
    spec: PolicySpec = PolicySpec()
    tenantId: TenantId | None = None


class PolicyPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/policies/{id}`: its name, or fields of its spec (merged)."""

    name: Annotated[str, Meta(max_length=128, pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]*)?$")] | (
        UnsetType
    ) = UNSET
    spec: PolicySpecPatch | UnsetType = UNSET


# -- pools, artifacts, cluster attributes -----------------------------------------------------

_LabelKey = Annotated[str, Meta(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9._/-]+$")]
_LabelValue = Annotated[str, Meta(max_length=253, pattern=r"^[^\x00]*$")]
_Taint = Annotated[str, Meta(min_length=1, max_length=317, pattern=r"^[^\x00]+$")]
_Labels = Annotated[dict[_LabelKey, _LabelValue], Meta(max_length=64)]
_Taints = Annotated[list[_Taint], Meta(max_length=64)]
_Shape = Annotated[str, Meta(max_length=128, pattern=r"^[^\x00]*$")]


class PoolSpec(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A pool's provisioning spec (recorded): the node shape, labels and taints."""

    nodeShape: _Shape = ""
    labels: _Labels = {}
    taints: _Taints = []


class PoolSpecPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A PATCH of a pool's spec: the fields given replace the stored ones."""

    nodeShape: _Shape | UnsetType = UNSET
    labels: _Labels | UnsetType = UNSET
    taints: _Taints | UnsetType = UNSET


class PoolCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/pools` (recorded: nvpair provisions nothing)."""

    name: Name
    clusterId: ClusterId | None = None
    deviceClass: DeviceClass
    minNodes: _Count = 0
    maxNodes: _Count
    spec: PoolSpec = PoolSpec()

    def __post_init__(self) -> None:
        check_nodes(self.minNodes, self.maxNodes)


class PoolPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/pools/{id}`."""

    name: Name | UnsetType = UNSET
    clusterId: ClusterId | UnsetType | None = UNSET
    deviceClass: DeviceClass | UnsetType = UNSET
    minNodes: _Count | UnsetType = UNSET
    maxNodes: _Count | UnsetType = UNSET
    spec: PoolSpecPatch | UnsetType = UNSET


def check_nodes(min_nodes: int, max_nodes: int) -> None:
    """A pool whose minimum is above its maximum is refused, naming the field."""
    if min_nodes > max_nodes:
        _refuse(f"minNodes ({min_nodes}) is above maxNodes ({max_nodes}) - at `$.minNodes`")


class ArtifactCreate(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/artifacts`: immutable weights, content-addressed by digest, in one or more
    storage locations. There is no PATCH: other weights are another artifact."""

    name: Annotated[str, Meta(max_length=256, pattern=r"^[^\x00]*$")] = ""
    digest: Digest
    kind: Literal["base", "fine-tune", "quantized", "lora"]
    locations: Annotated[list[Location], Meta(min_length=1, max_length=16)]
    tenantId: TenantId | None = None

    def __post_init__(self) -> None:
        if len(set(self.locations)) != len(self.locations):
            _refuse("a location is listed twice - at `$.locations`")


class ClusterAttrsPatch(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """`PATCH /v1/clusters/{id}`: the declared attributes policies test ("" clears one)."""

    region: _LabelOrNone | UnsetType = UNSET
    residency: _LabelOrNone | UnsetType = UNSET
    costPerDeviceHour: _Cost | UnsetType = UNSET
