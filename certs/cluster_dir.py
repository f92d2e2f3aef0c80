"""The cluster dir: this node's identity, the cluster CA, pins and invites on disk.

Layout (seed 002, DESIGN.md): `node.crt`, `node.key` (0600), `ca.crt`, `ca.key` (0600, on
nodes allowed to admit members), `trusted/` (one PEM per pinned member), `removed/`
(tombstones) and `invites/` (hashed invite secrets). The directory itself is 0700.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from certs._files import check_private, ensure_private_dir, write_atomic
from certs.errors import CertsError, NoIdentity, NotCAHolder
from certs.identity import (
    NodeCert,
    PrivateKey,
    cert_pem,
    describe,
    issue_node_cert,
    key_pem,
    load_cert,
    load_key,
    make_ca,
    new_key,
    operator_sans,
)
from certs.ids import new_node_id
from certs.pins import PinStore

__all__ = ["ClusterDir", "Identity", "default_cluster_dir"]


def default_cluster_dir(environ: dict[str, str] | None = None) -> Path:
    """`$NVPAIR_HOME/cluster`, with `NVPAIR_HOME` defaulting to `~/.nvpair`."""
    env = os.environ if environ is None else environ
    home = env.get("NVPAIR_HOME") or str(Path("~/.nvpair").expanduser())
    return Path(home) / "cluster"


@dataclass(frozen=True, slots=True)
class Identity:
    """This node's key and certificate and the cluster CA certificate."""

    key: PrivateKey
    cert: x509.Certificate
    ca: x509.Certificate
    node: NodeCert


class ClusterDir:
    """One node's cluster directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.node_crt = path / "node.crt"
        self.node_key = path / "node.key"
        self.ca_crt = path / "ca.crt"
        self.ca_key = path / "ca.key"
        self.trusted = path / "trusted"
        self.removed = path / "removed"
        self.invites = path / "invites"
        self.pins = PinStore(self.trusted, self.removed)

    # -- reading ------------------------------------------------------------------------------

    def has_identity(self) -> bool:
        """Whether node.crt, node.key and ca.crt are all present."""
        return all(p.exists() for p in (self.node_crt, self.node_key, self.ca_crt))

    def is_ca_holder(self) -> bool:
        """Whether this node holds ca.key and so may admit members."""
        return self.ca_key.exists()

    def load_identity(self) -> Identity:
        """Read and check this node's identity; refuses keys others can read."""
        if not self.has_identity():
            raise NoIdentity(
                f"{self.path} holds no cluster identity: run `nvpair cluster init` "
                "or `nvpair cluster join`"
            )
        check_private(self.path)
        check_private(self.node_key)
        try:
            key = load_key(self.node_key.read_bytes())
            cert = load_cert(self.node_crt.read_bytes())
            ca = load_cert(self.ca_crt.read_bytes())
        except ValueError as exc:
            raise CertsError(f"{self.path}: unreadable identity file ({exc})") from exc
        if cert.public_key() != key.public_key():
            raise CertsError(f"{self.node_crt} does not match {self.node_key}")
        return Identity(key=key, cert=cert, ca=ca, node=describe(cert))

    def load_ca(self) -> tuple[PrivateKey, x509.Certificate]:
        """The CA key and certificate; only on a CA holder."""
        if not self.is_ca_holder():
            raise NotCAHolder(f"{self.path} holds no ca.key: only a CA holder can do this")
        check_private(self.ca_key)
        return load_key(self.ca_key.read_bytes()), load_cert(self.ca_crt.read_bytes())

    def node_id(self) -> str | None:
        """This node's id, or None without an identity."""
        if not self.node_crt.exists():
            return None
        return describe(load_cert(self.node_crt.read_bytes())).node_id

    # -- writing ------------------------------------------------------------------------------

    def init(self, cluster_name: str, node_name: str, sans: Iterable[str] = ()) -> NodeCert:
        """Create the cluster CA and this node's identity, and pin this node."""
        if self.has_identity() or self.ca_key.exists():
            raise CertsError(f"{self.path} already holds a cluster identity")
        ensure_private_dir(self.path)
        ca_key, ca_cert = make_ca(cluster_name)
        write_atomic(self.ca_key, key_pem(ca_key), mode=0o600)
        write_atomic(self.ca_crt, cert_pem(ca_cert))
        key, cert = _new_member(ca_key, ca_cert, node_name, sans)
        self.write_identity(key, cert, ca_cert, pins=[cert])
        return describe(cert)

    def write_identity(
        self,
        key: PrivateKey,
        cert: x509.Certificate,
        ca: x509.Certificate,
        *,
        pins: Iterable[x509.Certificate],
    ) -> None:
        """Install an identity (from init, join or an offline issue) and its pins.

        The key goes first and the certificate last, so a server that resolves its identity
        per handshake never sees a certificate without its key.
        """
        ensure_private_dir(self.path)
        write_atomic(self.node_key, key_pem(key), mode=0o600)
        write_atomic(self.ca_crt, cert_pem(ca))
        for pinned in pins:
            self.pins.pin(pinned, ca=ca)
        write_atomic(self.node_crt, cert_pem(cert))

    def rotate(self, sans: Iterable[str] | None = None) -> NodeCert:
        """Re-issue this node's certificate with the same key: its pin stays valid."""
        identity = self.load_identity()
        ca_key, ca_cert = self.load_ca()
        if sans is None:
            sans = operator_sans(identity.cert.extensions)
        cert = issue_node_cert(
            ca_key=ca_key,
            ca_cert=ca_cert,
            public_key=identity.key.public_key(),
            node_id=identity.node.node_id,
            name=identity.node.name,
            sans=sans,
        )
        write_atomic(self.node_crt, cert_pem(cert))
        self.pins.pin(cert, ca=ca_cert)
        return describe(cert)

    def issue(self, name: str, out: Path, sans: Iterable[str] = ()) -> NodeCert:
        """Offline admission: write a complete cluster dir for another machine at `out`.

        `out` gets the new node's key and certificate, `ca.crt` and every current member's
        pin; the new node is pinned here too.
        """
        ca_key, ca_cert = self.load_ca()
        target = ClusterDir(out)
        if target.has_identity():
            raise CertsError(f"{out} already holds a cluster identity")
        key, cert = _new_member(ca_key, ca_cert, name, sans)
        self.pins.pin(cert, ca=ca_cert)
        members = [load_cert(pem) for pem in self.pins.pems()]
        target.write_identity(key, cert, ca_cert, pins=members)
        return describe(cert)


def _new_member(
    ca_key: PrivateKey, ca_cert: x509.Certificate, name: str, sans: Iterable[str]
) -> tuple[PrivateKey, x509.Certificate]:
    key = new_key()
    cert = issue_node_cert(
        ca_key=ca_key,
        ca_cert=ca_cert,
        public_key=key.public_key(),
        node_id=new_node_id(),
        name=name,
        sans=sans,
    )
    return key, cert
