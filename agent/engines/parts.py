"""When a part of a replica that spans members may start its engine, and with what (issue 32).

The values are the template's rendezvous placeholders (`agent.engines.templates`): `{rank}`,
`{nodes}`, `{workers}`, `{head_addr}`, `{dist_port}`. They come from the members' records --
no operator types an address:

- **A `tunnel` channel** (llama.cpp's RPC): a worker part starts at once (its engine listens
  on its member's loopback). The head part starts once every worker part is `ready` in its
  member's record; this member then opens a tunnel to each (`agent.engines.tunnel`), and
  `{workers}` lists their loopback ends in rank order.
- **A `network` channel** (NCCL, Ray, torch.distributed: traffic nvpair cannot tunnel at
  speed): only where the operator said the network between the members is trusted
  (`trusted` here). The head starts at once (unless its template waits for its workers);
  a worker part starts once its head's record shows the head's engine port: `{head_addr}`
  is the head member's first address and `{dist_port}` that port plus one (the head's own
  `{dist_port}` too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.engines.templates import LaunchTemplate
from agent.engines.tunnel import Tunnels
from facts.records import NodeRecord, Replica

__all__ = ["UNTRUSTED", "Waiting", "admit_worker", "part_values", "through_tunnels"]

UNTRUSTED = (
    "its engine's own traffic (NCCL, Ray) would cross the network between members in the "
    "clear: set [engines] trusted_network = true on every member where that network is yours"
)


@dataclass(frozen=True, slots=True)
class Waiting:
    """The part's engine cannot start yet; why (shown in its record)."""

    why: str


async def part_values(
    me: str,
    group: str,
    layout: Sequence[tuple[str, Sequence[str]]],
    rank: int,
    template: LaunchTemplate | None,
    records: Sequence[NodeRecord],
    tunnels: Tunnels,
    *,
    trusted: bool = False,
) -> dict[str, str | int] | Waiting:
    """The rendezvous values of part `rank` (replica `me` on this member) of `group`, laid
    out as `layout` ((member, GPUs) in rank order), or why it waits."""
    values: dict[str, str | int] = {"rank": rank, "nodes": len(layout)}
    if template is None or template.span is None:
        return values  # its launch says why it cannot run
    span = template.span
    if span.channel == "network" and not trusted:
        return Waiting(UNTRUSTED)
    by_node = {r.nodeId: r for r in records}
    head_record = by_node.get(layout[0][0])
    if rank > 0:
        if span.channel == "tunnel":
            return values
        head = _part(head_record, group)
        if head_record is None or head is None or not head.port or not head_record.addresses:
            return Waiting(f"waiting for its head on {_name(head_record, layout[0][0])}")
        return values | {"head_addr": head_record.addresses[0], "dist_port": head.port + 1}
    if head_record is not None and head_record.addresses:
        values["head_addr"] = head_record.addresses[0]
    if not span.head_waits:
        return values
    endpoints = []
    for node, _ in layout[1:]:
        record = by_node.get(node)
        worker = _part(record, group)
        if record is None or worker is None:
            return Waiting(f"waiting for its part on {_name(record, node)}")
        if worker.state != "ready":
            return Waiting(f"its part on {_name(record, node)} is {worker.state}")
        if span.channel == "tunnel":
            endpoints.append(f"127.0.0.1:{await tunnels.open(me, node, worker.id)}")
        elif record.addresses and worker.port:
            endpoints.append(f"{record.addresses[0]}:{worker.port}")
        else:
            return Waiting(f"no address of {_name(record, node)} to reach its part at")
    return values | {"workers": ",".join(endpoints)}


def through_tunnels(template: LaunchTemplate | None) -> bool:
    """Whether the parts of a replica of `template` reach each other through the agents'
    tunnels (which end with the head's agent: its engine's connections go with them)."""
    return template is not None and template.span is not None and template.span.channel == "tunnel"


def admit_worker(replica: str, head: str, caller: str, port: int) -> int | str:
    """The port a tunnel from `caller` reaches for `replica`, a worker part here whose head
    runs on member `head` ("" when it is no worker part) with its engine on `port` (0: not
    running); else why not (`agent.engines.tunnel`: only the head's member gets through)."""
    if not head:
        return f"{replica} is no worker part of a replica on this member"
    if caller != head:
        return f"only the member of its head ({head}) reaches {replica}"
    if not port:
        return f"{replica}: its engine does not run"
    return port


def _part(record: NodeRecord | None, group: str) -> Replica | None:
    if record is None:
        return None
    return next((r for r in record.replicas if r.group == group), None)


def _name(record: NodeRecord | None, node: str) -> str:
    return record.name if record is not None and record.name else node
