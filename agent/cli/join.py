"""`nvpair cluster join HOST:PORT TOKEN` over the network: fetch the CA, check it against the
invite, then send the secret and a CSR over TLS verified against that CA."""

from __future__ import annotations

import asyncio
import ssl

import aiohttp
import msgspec

from agent.apis.node import JoinAnswer
from agent.cluster.api_keys import save_joined
from agent.cluster.members import SEEDS_FILE
from agent.core.errors import AgentError
from certs import (
    CertsError,
    ClusterDir,
    JoinResponse,
    complete_join,
    prepare_join,
    write_atomic,
)
from certs.identity import ca_fingerprint, load_cert
from certs.invites import parse_token

__all__ = ["JoinFailed", "join_cluster", "join_over_network"]


class JoinFailed(AgentError):
    """The join did not happen; the message says why (the invite, the member, the network)."""


def join_over_network(
    address: str, token: str, name: str, sans: list[str], cluster: ClusterDir
) -> str:
    """Join through the member at `address`; returns this node's new id."""
    try:
        return asyncio.run(join_cluster(address, token, name, sans, cluster))
    except (CertsError, aiohttp.ClientError, OSError, ValueError) as exc:
        raise JoinFailed(str(exc)) from exc


async def join_cluster(
    address: str, token: str, name: str, sans: list[str], cluster: ClusterDir
) -> str:
    """Join through the member at `address` (HOST:PORT) with an invite `token`, as `name`;
    this node's new id. Raises CertsError, aiohttp.ClientError, OSError or ValueError."""
    invite = parse_token(token)  # refuses a malformed token before any traffic
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not HOST:PORT: {address!r}")
    base = f"https://{host}:{port}"
    # 1. Fetch the CA over an unverified channel and check it against the invite.
    anyone = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anyone.check_hostname = False
    anyone.verify_mode = ssl.CERT_NONE
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        async with session.get(f"{base}/v1/cluster/ca", ssl=anyone) as response:
            ca_pem = await response.read()
        try:
            ca = load_cert(ca_pem)
        except ValueError:
            raise CertsError("the member did not answer with a CA certificate") from None
        if ca_fingerprint(ca) != invite.ca_fingerprint:
            raise CertsError("the member's cluster CA is not the one the invite names")
        # 2. Send the secret only over a channel verified against that CA.
        verified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        verified.check_hostname = False  # any member of that CA may admit us
        verified.load_verify_locations(cadata=ca_pem.decode())
        request, key = prepare_join(token, name, sans)
        async with session.post(
            f"{base}/v1/join",
            data=msgspec.json.encode(request),
            headers={"Content-Type": "application/json"},
            ssl=verified,
        ) as response:
            body = await response.read()
            if response.status != 200:
                raise CertsError(
                    f"refused ({response.status}): {body.decode(errors='replace').strip()}"
                )
    answer = msgspec.json.decode(body, type=JoinAnswer)
    node_id = complete_join(
        cluster,
        token,
        key,
        JoinResponse(cert=answer.cert, ca=answer.ca, pins=answer.pins, removed=answer.removed),
    )
    seeds = cluster.path.parent / SEEDS_FILE
    write_atomic(seeds, msgspec.json.encode(answer.records))  # 0600 from the start
    save_joined(cluster.path.parent, answer.apiKeys, load_cert(answer.ca.encode()))
    return node_id
