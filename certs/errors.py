"""Typed errors of the trust layer; each says whose fault it is and what to do."""

from __future__ import annotations

__all__ = [
    "BadCertificate",
    "BadInviteLifetime",
    "BadJoinResponse",
    "CertsError",
    "InsecurePermissions",
    "InviteRefused",
    "NoIdentity",
    "NotCAHolder",
    "PinRefused",
]


class CertsError(Exception):
    """Base of every error the `certs` package raises on purpose."""


class InsecurePermissions(CertsError):
    """A private file or directory is readable or writable by others."""


class NoIdentity(CertsError):
    """This node has no cluster identity (no node.crt / node.key / ca.crt)."""


class NotCAHolder(CertsError):
    """The operation needs ca.key, which this node does not hold."""


class PinRefused(CertsError):
    """A certificate cannot be pinned (removed member, wrong CA, no node id)."""


class InviteRefused(CertsError):
    """A join was refused: the invite is expired, used, forged or for another cluster."""


class BadJoinResponse(CertsError):
    """The admitter's answer does not match the invite (wrong CA, wrong key, bad chain)."""


class BadCertificate(CertsError, ValueError):
    """Bytes that are not a PEM certificate, or a key that is not an EC P-256 private key:
    the fault of whoever supplied the file."""


class BadInviteLifetime(CertsError, ValueError):
    """An invite lifetime outside what invites allow (the caller's fault)."""
