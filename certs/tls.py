"""`ssl.SSLContext`s for cluster mTLS, built only when the identity files change.

Server: the listening context has no certificate of its own. Its `sni_callback` resolves
`node.crt` / `node.key` per handshake and swaps in a context built from them, so a node that
gets its identity later starts serving without a rebind; without an identity every handshake
fails. The outer context is `CERT_REQUIRED` (after the swap, OpenSSL still takes
`verify_mode` from the outer context) and the inner one trusts the cluster CA; the pin check
is per HTTP request (`certs.pinned_peer`, run by `netkit.guard`). TLS 1.3 only.

Session tickets stay on: a resumed session still presents the original client certificate
to `getpeercert()`, and the per-request pin check refuses a removed member on it just as on
a full handshake (tests/certs/test_tls_server.py shows it), so resumption saves the ~5 ms
handshake without weakening removal.

Client: presents this node's identity, trusts the cluster CA, and checks that the server
is the node it meant to reach through the DNS SAN `<node id>.nvpair.internal`
(`server_hostname_for`), while it connects by address.
"""

from __future__ import annotations

import logging
import ssl
import time
from pathlib import Path
from typing import Final

from certs._files import check_private, file_stamp
from certs.cluster_dir import ClusterDir
from certs.errors import CertsError
from certs.ids import node_dns_name

__all__ = ["FORWARD_ALPN", "ClientContexts", "ServerContexts", "server_hostname_for"]

log = logging.getLogger(__name__)

_Stamp = tuple[tuple[int, int, int, int] | None, ...]

# A client asks for its context per relay batch and per forwarded request; three stat() calls
# each were a tenth of the agent's time under load. A client picks up a rotated identity
# within this; a server looks at every handshake (a key left readable fails the next one).
CLIENT_RECHECK_S: Final = 1.0
# The ALPN name of forwarded inference on the node API (issue 33): a connection that agrees
# on it is served by the facade's lean HTTP/1.1 server, any other by aiohttp. The bytes on
# the wire are HTTP/1.1 either way, so a member that does not know the name serves it too.
FORWARD_ALPN: Final = "nvpair-forward/1"


def server_hostname_for(node_id: str) -> str:
    """The name a client checks when it expects to reach `node_id`."""
    return node_dns_name(node_id)


class _IdentityCache:
    """Builds a context from the identity files, again only when they change."""

    def __init__(
        self,
        cluster: ClusterDir,
        purpose: ssl.Purpose,
        recheck_s: float = 0.0,
        alpn: tuple[str, ...] = (),
    ) -> None:
        self.cluster = cluster
        self.alpn = alpn
        self.purpose = purpose
        self.recheck_s = recheck_s
        self._stamp: _Stamp | None = None
        self._context: ssl.SSLContext | None = None
        self._checked = 0.0
        self.builds = 0

    def _files(self) -> tuple[Path, ...]:
        return (self.cluster.node_crt, self.cluster.node_key, self.cluster.ca_crt)

    def current(self) -> ssl.SSLContext | None:
        """The context for the files as they are now (looked at again at most every
        `recheck_s` while they make a usable identity, at every call while they do not), or
        None without an identity."""
        now = time.monotonic()
        if self._context is not None and now - self._checked < self.recheck_s:
            return self._context
        self._checked = now
        stamp = tuple(file_stamp(path) for path in self._files())
        if stamp != self._stamp:
            self._context = self._build() if None not in stamp else None
            self._stamp = stamp
        return self._context

    def _build(self) -> ssl.SSLContext | None:
        cluster = self.cluster
        try:
            check_private(cluster.node_key)
            if self.purpose is ssl.Purpose.CLIENT_AUTH:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            else:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname = True
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_cert_chain(cluster.node_crt, cluster.node_key)
            context.load_verify_locations(cafile=cluster.ca_crt)
            if self.alpn:
                context.set_alpn_protocols(list(self.alpn))
        except (OSError, ssl.SSLError, CertsError) as exc:
            # Half-written files (a join in progress) or a refused key: no identity for now.
            log.error("cluster identity in %s is unusable: %s", cluster.path, exc)
            return None
        self.builds += 1
        return context


class ServerContexts:
    """The listening context for an mTLS server, resolving its identity per handshake."""

    def __init__(
        self,
        cluster: ClusterDir,
        *,
        client_certificate: str = "required",
        alpn: tuple[str, ...] = (),
    ) -> None:
        """`client_certificate="optional"` lets a caller without a certificate through the
        handshake (one that sends a certificate must still chain to the cluster CA); the
        per-request guard then refuses it everywhere but where that is the point (join).
        `alpn`: the protocols a client may agree on (none agreed: plain HTTP/1.1)."""
        self._identity = _IdentityCache(cluster, ssl.Purpose.CLIENT_AUTH, alpn=alpn)
        outer = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if alpn:
            outer.set_alpn_protocols(list(alpn))
        outer.minimum_version = ssl.TLSVersion.TLSv1_3
        if client_certificate not in ("required", "optional"):
            raise ValueError("client_certificate is 'required' or 'optional'")
        outer.verify_mode = (
            ssl.CERT_REQUIRED if client_certificate == "required" else ssl.CERT_OPTIONAL
        )
        if cluster.ca_crt.exists():
            outer.load_verify_locations(cafile=cluster.ca_crt)
        outer.sni_callback = self._on_client_hello
        self.listening = outer
        self.refused_handshakes = 0

    @property
    def builds(self) -> int:
        """How many inner contexts were built: once per change of the identity files."""
        return self._identity.builds

    def _on_client_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, outer: ssl.SSLContext
    ) -> int | None:
        context = self._identity.current()
        if context is None:
            self.refused_handshakes += 1
            return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE
        conn.context = context
        return None


class ClientContexts:
    """The client context that presents this node's identity, rebuilt on change."""

    def __init__(self, cluster: ClusterDir, *, alpn: tuple[str, ...] = ()) -> None:
        """`alpn`: the protocols offered (forwarded inference offers `FORWARD_ALPN`)."""
        self._identity = _IdentityCache(
            cluster, ssl.Purpose.SERVER_AUTH, CLIENT_RECHECK_S, alpn=alpn
        )

    def current(self) -> ssl.SSLContext:
        """The context to connect with; raises `CertsError` without an identity."""
        context = self._identity.current()
        if context is None:
            raise CertsError(f"no usable cluster identity in {self._identity.cluster.path}")
        return context
