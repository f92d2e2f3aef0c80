"""Cluster identity: the CA, node certificates, the `trusted/` pin store, invites and TLS
contexts. No network I/O and no web framework here: the servers and clients that use it, and
the aiohttp pin guard (`netkit.guard`), live elsewhere.
"""

from certs._files import make_private_dir, write_atomic
from certs.cluster_dir import ClusterDir, Identity, default_cluster_dir
from certs.errors import (
    BadCertificate,
    BadInviteLifetime,
    BadJoinResponse,
    CertsError,
    InsecurePermissions,
    InviteRefused,
    NoIdentity,
    NotCAHolder,
    PinRefused,
)
from certs.identity import NodeCert, spki_sha256
from certs.ids import is_node_id, new_node_id, prefixed_ulid
from certs.invites import (
    JoinRequest,
    JoinResponse,
    admit,
    complete_join,
    create_invite,
    prepare_join,
)
from certs.pin_check import pinned_peer
from certs.pins import Member, PinStore
from certs.tls import FORWARD_ALPN, ClientContexts, ServerContexts, server_hostname_for

__all__ = [
    "FORWARD_ALPN",
    "BadCertificate",
    "BadInviteLifetime",
    "BadJoinResponse",
    "CertsError",
    "ClientContexts",
    "ClusterDir",
    "Identity",
    "InsecurePermissions",
    "InviteRefused",
    "JoinRequest",
    "JoinResponse",
    "Member",
    "NoIdentity",
    "NodeCert",
    "NotCAHolder",
    "PinRefused",
    "PinStore",
    "ServerContexts",
    "admit",
    "complete_join",
    "create_invite",
    "default_cluster_dir",
    "is_node_id",
    "make_private_dir",
    "new_node_id",
    "pinned_peer",
    "prefixed_ulid",
    "prepare_join",
    "server_hostname_for",
    "spki_sha256",
    "write_atomic",
]
