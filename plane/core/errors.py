"""The plane's errors, each saying whose fault it is and carrying the HTTP status it maps to.

The store translates psycopg's errors into these once, where it talks to the database
(`plane.db.connection.connection`), and the HTTP API answers each with its `status`: the caller's
mistakes are 4xx, a database that is down is 503 with `Retry-After`, and anything else is
our bug (500, logged).
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BadInput",
    "ClusterNameTaken",
    "Conflict",
    "DatabaseUnavailable",
    "InvalidId",
    "InvalidServingConfig",
    "MigrationError",
    "PlaneError",
    "SignatureMalformed",
    "SignatureRefused",
    "SyncRefused",
]


class PlaneError(Exception):
    """Base of the plane's errors; `status` is what the HTTP API answers."""

    status: ClassVar[int] = 500


class InvalidId(PlaneError, ValueError):
    """Not an id of the expected kind (the caller's fault); the message says which and why."""

    status = 400


class InvalidServingConfig(PlaneError, ValueError):
    """A serving configuration with no canonical form (NaN, non-string keys): the caller's."""

    status = 400


class SyncRefused(PlaneError):
    """A batch that breaks the one-writer rule or names objects badly (the sender's fault)."""

    status = 400


class SignatureRefused(PlaneError):
    """A sync that is not the named node's own: unsigned, signed by another node or with
    another key, a certificate out of its validity or of another cluster CA (the sender's
    fault; nothing written)."""

    status = 403


class SignatureMalformed(PlaneError):
    """Signature headers that cannot be read (not base64url, not DER, one missing): the
    sender's fault, nothing written."""

    status = 400


class BadInput(PlaneError):
    """A value the database refuses as data (a NUL in a string, a number out of range): the
    caller's fault, nothing was written."""

    status = 400


class Conflict(PlaneError):
    """The request collides with what is stored (a unique key): the caller's fault."""

    status = 409


class ClusterNameTaken(Conflict):
    """A cluster of that name is enrolled already."""


class DatabaseUnavailable(PlaneError):
    """PostgreSQL cannot be reached or dropped the connection: nobody's fault here, and
    worth retrying after `retry_after_s`."""

    status = 503

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MigrationError(PlaneError):
    """The shipped migrations are inconsistent (a packaging bug: ours)."""

    status = 500
