"""The cluster dir on disk: identities, pins, tombstones, permissions, rotation."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest

from certs import CertsError, ClusterDir, InsecurePermissions, NoIdentity, PinRefused, is_node_id
from certs.identity import load_cert


@pytest.fixture
def a(tmp_path: Path) -> ClusterDir:
    cluster = ClusterDir(tmp_path / "a")
    cluster.init("lab", "gpu-a", ["127.0.0.1", "gpu-a.lan"])
    return cluster


def test_init_layout_and_modes(a: ClusterDir) -> None:
    assert a.path.stat().st_mode & 0o777 == 0o700
    for key in (a.node_key, a.ca_key):
        assert key.stat().st_mode & 0o777 == 0o600
    node_id = a.node_id()
    assert node_id is not None
    assert is_node_id(node_id)
    assert (a.trusted / f"{node_id}.pem").exists()
    identity = a.load_identity()
    assert identity.node.name == "gpu-a"
    validity = identity.cert.not_valid_after_utc - identity.cert.not_valid_before_utc
    assert validity < datetime.timedelta(days=366)


def test_init_twice_is_refused(a: ClusterDir) -> None:
    with pytest.raises(CertsError, match="already holds a cluster identity"):
        a.init("lab", "again")


def test_no_identity_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoIdentity, match="nvpair cluster init"):
        ClusterDir(tmp_path / "none").load_identity()


@pytest.mark.parametrize("which", ["node.key", "ca.key"])
def test_loose_key_permissions_are_refused(a: ClusterDir, which: str) -> None:
    path = a.path / which
    os.chmod(path, 0o640)
    with pytest.raises(
        InsecurePermissions, match=f"{which} is accessible by other users.*chmod 600"
    ):
        a.load_identity() if which == "node.key" else a.load_ca()


def test_loose_directory_is_refused(a: ClusterDir) -> None:
    os.chmod(a.path, 0o755)
    with pytest.raises(InsecurePermissions, match="chmod 700"):
        a.load_identity()


def test_rotate_keeps_the_pin_and_the_node_id(a: ClusterDir) -> None:
    before = a.load_identity()
    after_info = a.rotate()
    after = a.load_identity()
    assert after.cert.serial_number != before.cert.serial_number
    assert after_info.pin == before.node.pin
    assert after_info.node_id == before.node.node_id
    assert a.pins.is_pinned(before.node.pin)


def test_rotate_needs_the_ca(a: ClusterDir, tmp_path: Path) -> None:
    from certs import NotCAHolder

    a.issue("gpu-b", tmp_path / "b")
    with pytest.raises(NotCAHolder):
        ClusterDir(tmp_path / "b").rotate()


def test_unpin_leaves_a_tombstone_that_a_stale_record_cannot_beat(
    a: ClusterDir, tmp_path: Path
) -> None:
    info = a.issue("gpu-b", tmp_path / "b")
    stale = load_cert((tmp_path / "b" / "node.crt").read_bytes())
    assert a.pins.is_pinned(info.pin)
    a.pins.unpin(info.node_id)
    assert not a.pins.is_pinned(info.pin)
    with pytest.raises(PinRefused, match="was removed"):
        a.pins.pin(stale)
    # even a stale PEM copied back into trusted/ by hand pins nothing
    (a.trusted / f"{info.node_id}.pem").write_bytes((tmp_path / "b" / "node.crt").read_bytes())
    assert not a.pins.is_pinned(info.pin)
    [member] = [m for m in a.pins.members() if m.node_id == info.node_id]
    assert member.removed is not None


def test_pin_refuses_another_clusters_certificate(a: ClusterDir, tmp_path: Path) -> None:
    other = ClusterDir(tmp_path / "o")
    other.init("other", "x")
    with pytest.raises(PinRefused, match="not signed by this cluster's CA"):
        a.pins.pin(load_cert(other.node_crt.read_bytes()), ca=load_cert(a.ca_crt.read_bytes()))


def test_pin_check_sees_removal_at_once_and_caches_otherwise(a: ClusterDir, tmp_path: Path) -> None:
    info = a.issue("gpu-b", tmp_path / "b")
    pins = ClusterDir(a.path).pins  # a second reader, like another process
    assert pins.is_pinned(info.pin)
    a.pins.unpin(info.node_id)
    assert not pins.is_pinned(info.pin)


def test_settled_pins_are_served_from_the_cache(a: ClusterDir, tmp_path: Path) -> None:
    a.issue("gpu-b", tmp_path / "b")
    old = time.time() - 60
    for path in [a.trusted, *a.trusted.iterdir()]:
        os.utime(path, (old, old))
    pins = ClusterDir(a.path).pins
    for _ in range(50):
        pins.is_pinned(b"x" * 32)
    assert pins.reloads == 1


def test_corrupt_pin_file_pins_nothing_and_breaks_nothing(a: ClusterDir) -> None:
    (a.trusted / "garbage.pem").write_bytes(b"not a certificate")
    node_id = a.node_id()
    assert [m.node_id for m in a.pins.members()] == [node_id]


def test_issue_writes_a_complete_dir_and_pins_locally(a: ClusterDir, tmp_path: Path) -> None:
    info = a.issue("gpu-b", tmp_path / "b")
    b = ClusterDir(tmp_path / "b")
    assert b.load_identity().node.node_id == info.node_id
    assert {m.node_id for m in b.pins.members()} == {a.node_id(), info.node_id}
    assert a.pins.is_pinned(info.pin)
    assert b.ca_crt.read_bytes() == a.ca_crt.read_bytes()


def test_files_that_are_not_ours_are_bad_certificate_errors(a: ClusterDir) -> None:
    from certs import BadCertificate
    from certs.identity import load_key

    with pytest.raises(BadCertificate, match="not a PEM certificate"):
        load_cert(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")
    with pytest.raises(BadCertificate, match="private key"):
        load_key(a.node_crt.read_bytes())  # a certificate where a key belongs
    # The control: the real files load.
    assert load_cert(a.node_crt.read_bytes()).subject
    assert load_key(a.node_key.read_bytes()).curve.name == "secp256r1"
    assert issubclass(BadCertificate, CertsError)
