"""The pin check on one TLS connection, without a web framework.

TLS proves the peer holds a certificate of the cluster CA; the pin check asks the pin store
whether that certificate's key belongs to a current member, and whether the certificate is
still within its validity now. Servers run it on every request (`netkit.guard` for
aiohttp), which is what refuses a removed member, or one whose certificate has expired, on a
kept-alive connection or a resumed TLS session, where no new handshake verifies anything.
"""

from __future__ import annotations

import functools
import ssl
import time

from cryptography import x509

from certs.identity import spki_sha256
from certs.pins import PinStore

__all__ = ["pinned_peer"]


@functools.lru_cache(maxsize=1024)
def _facts_of_der(der: bytes) -> tuple[bytes, float, float] | None:
    # (pin, notBefore, notAfter as epoch seconds) of a peer's DER certificate, parsed once per
    # certificate: a request pays a dict lookup and a clock read, not an X.509 parse.
    try:
        cert = x509.load_der_x509_certificate(der)
        return (
            spki_sha256(cert),
            cert.not_valid_before_utc.timestamp(),
            cert.not_valid_after_utc.timestamp(),
        )
    except ValueError:
        return None


def pinned_peer(
    ssl_object: ssl.SSLObject | ssl.SSLSocket | None, pins: PinStore, *, now: float | None = None
) -> str | None:
    """The node id of the pinned member at the other end of `ssl_object`, or None.

    None for a plaintext connection, a peer that sent no certificate, one whose key is not
    pinned (never pinned, or removed), and one whose certificate is outside its validity at
    `now` (default: the clock): expired since the handshake, on a kept-alive connection or a
    resumed session.
    """
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    facts = _facts_of_der(der)
    if facts is None:
        return None
    pin, not_before, not_after = facts
    if not not_before <= (time.time() if now is None else now) <= not_after:
        return None
    return pins.node_id_of(pin)
