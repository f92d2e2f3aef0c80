"""Invites and the join functions: a happy join, and every refusal with its clear error."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from certs import (
    BadJoinResponse,
    ClusterDir,
    InviteRefused,
    JoinRequest,
    PinRefused,
    admit,
    complete_join,
    create_invite,
    prepare_join,
)
from certs.identity import describe, load_cert, verify_issued_by
from certs.invites import check_admitter, parse_token
from tests.fixtures.clock import FakeClock


@pytest.fixture
def admitter(tmp_path: Path) -> ClusterDir:
    cluster = ClusterDir(tmp_path / "a")
    cluster.init("lab", "gpu-a")
    return cluster


def join(admitter: ClusterDir, joiner_dir: Path, token: str, *, now: float | None = None) -> str:
    request, key = prepare_join(token, "gpu-b", ["10.0.0.7", "gpu-b.lan"])
    response = admit(admitter, request, now=now)
    return complete_join(ClusterDir(joiner_dir), token, key, response)


def test_join_installs_an_identity_and_pins_both_ways(admitter: ClusterDir, tmp_path: Path) -> None:
    token = create_invite(admitter).token()
    assert token.startswith("nvp1.")
    node_id = join(admitter, tmp_path / "b", token)
    joiner = ClusterDir(tmp_path / "b")
    identity = joiner.load_identity()
    assert identity.node.node_id == node_id
    assert identity.node.name == "gpu-b"
    assert verify_issued_by(identity.cert, load_cert(admitter.ca_crt.read_bytes()))
    a_id = admitter.node_id()
    assert {m.node_id for m in joiner.pins.members()} == {a_id, node_id}
    assert {m.node_id for m in admitter.pins.members()} == {a_id, node_id}
    assert not joiner.is_ca_holder()
    assert (tmp_path / "b" / "node.key").stat().st_mode & 0o777 == 0o600


def test_admitter_mints_the_node_id_and_keeps_only_dns_and_ip_sans(admitter: ClusterDir) -> None:
    token = create_invite(admitter).token()
    request, _ = prepare_join(token, "gpu-b", ["10.0.0.7", "gpu-b.lan"])
    cert = load_cert(admit(admitter, request).cert.encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName)[1:] == ["gpu-b.lan"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert describe(cert).node_id != admitter.node_id()


def test_expired_invite_is_refused(
    admitter: ClusterDir, tmp_path: Path, fake_clock: FakeClock
) -> None:
    # Both ends take the clock, so two minutes pass without waiting for them.
    ttl = datetime.timedelta(minutes=1)
    token = create_invite(admitter, ttl=ttl, now=fake_clock()).token()
    with pytest.raises(InviteRefused, match=r"invite expired at .*ask for a new one"):
        join(admitter, tmp_path / "b", token, now=fake_clock.advance(120))


def test_reused_invite_is_refused(admitter: ClusterDir, tmp_path: Path) -> None:
    token = create_invite(admitter).token()
    join(admitter, tmp_path / "b", token)
    with pytest.raises(InviteRefused, match="invite already used at"):
        join(admitter, tmp_path / "c", token)
    assert not ClusterDir(tmp_path / "c").has_identity()


def test_forged_secret_is_refused(admitter: ClusterDir, tmp_path: Path) -> None:
    invite = create_invite(admitter)
    forged = type(invite)(invite.ca_fingerprint, invite.invite_id, b"\x00" * 32, invite.expires_at)
    with pytest.raises(InviteRefused, match="secret does not match"):
        join(admitter, tmp_path / "b", forged.token())
    # the real token still works: a forgery does not use the invite up
    join(admitter, tmp_path / "b", invite.token())


def test_made_up_invite_is_refused(admitter: ClusterDir, tmp_path: Path) -> None:
    invite = create_invite(admitter)
    made_up = type(invite)(
        invite.ca_fingerprint, "01ARZ3NDEKTSV4RRFFQ69G5FAV", invite.secret, invite.expires_at
    )
    with pytest.raises(InviteRefused, match="not recognised"):
        join(admitter, tmp_path / "b", made_up.token())


def test_invite_of_another_cluster_is_refused(admitter: ClusterDir, tmp_path: Path) -> None:
    other = ClusterDir(tmp_path / "other")
    other.init("other", "x")
    token = create_invite(other).token()
    with pytest.raises(InviteRefused, match="invite is for another cluster"):
        join(admitter, tmp_path / "b", token)


@pytest.mark.parametrize(
    "token", ["", "hello", "nvp1.", "nvp1.!!!", "nvp1.QUJD", "nvp2.AAAA", "nvp1." + "A" * 500]
)
def test_malformed_token_is_refused_clearly(token: str) -> None:
    with pytest.raises(InviteRefused, match="invite"):
        parse_token(token)


def test_joiner_refuses_an_answer_from_another_ca(admitter: ClusterDir, tmp_path: Path) -> None:
    other = ClusterDir(tmp_path / "other")
    other.init("other", "x")
    token = create_invite(admitter).token()
    request, key = prepare_join(token, "gpu-b")
    response = admit(admitter, request)
    swapped = type(response)(cert=response.cert, ca=other.ca_crt.read_text(), pins=response.pins)
    with pytest.raises(BadJoinResponse, match="not the one the invite names"):
        complete_join(ClusterDir(tmp_path / "b"), token, key, swapped)
    wrong_key = prepare_join(create_invite(admitter).token(), "gpu-c")[1]
    with pytest.raises(BadJoinResponse, match="not for our key"):
        complete_join(ClusterDir(tmp_path / "b"), token, wrong_key, response)
    assert not ClusterDir(tmp_path / "b").has_identity()


def test_check_admitter_against_the_token(admitter: ClusterDir, tmp_path: Path) -> None:
    token = create_invite(admitter).token()
    server_der = load_cert(admitter.node_crt.read_bytes()).public_bytes(Encoding.DER)
    check_admitter(token, admitter.ca_crt.read_bytes(), server_der)
    other = ClusterDir(tmp_path / "other")
    other.init("other", "x")
    with pytest.raises(BadJoinResponse):
        check_admitter(token, other.ca_crt.read_bytes(), server_der)


def test_bad_csr_is_refused_and_does_not_use_the_invite(
    admitter: ClusterDir, tmp_path: Path
) -> None:
    token = create_invite(admitter).token()
    request, _ = prepare_join(token, "gpu-b")
    bad = JoinRequest(
        caFingerprint=request.caFingerprint,
        inviteId=request.inviteId,
        secret=request.secret,
        name=request.name,
        csr="-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
    )
    with pytest.raises(InviteRefused, match="not a PEM CSR"):
        admit(admitter, bad)
    join(admitter, tmp_path / "b", token)


def test_only_a_ca_holder_can_invite(admitter: ClusterDir, tmp_path: Path) -> None:
    from certs import NotCAHolder

    admitter.issue("gpu-b", tmp_path / "b")
    with pytest.raises(NotCAHolder, match="only a CA holder"):
        create_invite(ClusterDir(tmp_path / "b"))


def test_invite_lifetime_is_bounded(admitter: ClusterDir) -> None:
    with pytest.raises(ValueError, match="between 1 second and 7 days"):
        create_invite(admitter, ttl=datetime.timedelta(days=30))


def test_a_joiner_gets_the_removals_before_it_pins_anything(
    admitter: ClusterDir, tmp_path: Path
) -> None:
    # b joined and was removed; a stale member still offers b's certificate. The joiner
    # learns the removal with its identity, so it never pins b.
    b_id = join(admitter, tmp_path / "b", create_invite(admitter).token())
    b_cert = ClusterDir(tmp_path / "b").load_identity().cert
    admitter.pins.unpin(b_id)
    c_id = join(admitter, tmp_path / "c", create_invite(admitter).token())
    joiner = ClusterDir(tmp_path / "c")
    members = {m.node_id: m for m in joiner.pins.members()}
    assert members[b_id].removed is not None
    assert not joiner.pins.is_member(b_id)
    with pytest.raises(PinRefused):
        joiner.pins.pin(b_cert)
    # The control: the admitter is pinned, and so is the joiner itself.
    assert joiner.pins.is_member(admitter.node_id() or "")
    assert joiner.pins.is_member(c_id)
