"""The pin check on one TLS connection, without a web framework.

TLS proves the peer holds a certificate of the cluster CA; the pin check asks the pin store
whether that certificate's key belongs to a current member. Servers run it on every request
(`workload_manager.guard` for aiohttp), which is what refuses a removed member on a
kept-alive connection or a resumed TLS session, where no new handshake happens.
"""

from __future__ import annotations

import ssl

from .pins import PinStore

__all__ = ["pinned_peer"]


def pinned_peer(ssl_object: ssl.SSLObject | ssl.SSLSocket | None, pins: PinStore) -> str | None:
    """The node id of the pinned member at the other end of `ssl_object`, or None.

    None for a plaintext connection, a peer that sent no certificate, or one whose key is not
    pinned (never pinned, or removed).
    """
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return pins.node_id_of_cert_der(der)
