"""Forward-compatible signed facts (issue 27, item 3): a record or fact signed by a later
release, with fields this one does not know, is verified over the bytes it came in, kept
and relayed as those bytes, and understood for what this release knows; bytes altered
after signing, or a signature that is not where the signer put it, are refused."""

from __future__ import annotations

import time

import msgspec
import pytest
from cryptography import x509

from certs import new_node_id
from certs.identity import PrivateKey, issue_node_cert, make_ca, new_key
from facts.deployments import Deployment, DeploymentSet
from facts.kept import Kept, raws
from facts.membership import PushPlan, plan_push
from facts.record_signing import RecordVerifier, signed_payload
from facts.records import NodeRecord, RecordsPush
from tests.fixtures.newer import newer_record, newer_statement
from tests.fixtures.records import node_record

ME, B = new_node_id(), new_node_id()
KEYS = {node_id: new_key() for node_id in (ME, B)}


@pytest.fixture(scope="module")
def ca() -> tuple[PrivateKey, x509.Certificate]:
    return make_ca("lab")


@pytest.fixture(scope="module")
def b_cert(ca: tuple[PrivateKey, x509.Certificate]) -> x509.Certificate:
    ca_key, ca_cert = ca
    public = KEYS[B].public_key()
    return issue_node_cert(ca_key=ca_key, ca_cert=ca_cert, public_key=public, node_id=B, name="b")


def plan(push: RecordsPush, ca_cert: x509.Certificate, verifier: RecordVerifier) -> PushPlan:
    wire = msgspec.json.encode(push)  # through the wire, as a member receives it
    return plan_push(
        msgspec.json.decode(wire, type=RecordsPush),
        self_id=ME,
        ca=ca_cert,
        is_member=lambda node_id: node_id == B,
        is_removed=lambda _: False,
        key_of=lambda node_id: KEYS[B].public_key() if node_id == B else None,
        verifier=verifier,
        now_ms=int(time.time() * 1000),
    )


def test_a_newer_members_record_verifies_over_its_bytes_and_is_kept_whole(
    ca: tuple[PrivateKey, x509.Certificate],
) -> None:
    raw = newer_record(node_record(B, 5), KEYS[B], zone="eu-1", accelerators={"npu": 2})
    verifier = RecordVerifier()
    (kept,) = plan(RecordsPush(records=[msgspec.Raw(raw)]), ca[1], verifier).offers
    assert kept.raw == raw  # kept as signed, unknown fields and all
    assert (kept.fact.nodeId, kept.fact.generation) == (B, 5)  # understood for what it knows
    # The rule it replaces: a re-encoding drops what it does not know, and no longer verifies.
    again = verifier.why_not(kept.fact, KEYS[B].public_key(), now_ms=0, raw=None)
    assert again is not None
    assert "did not sign" in again


def test_a_newer_deployment_is_kept_relayed_and_verified_unchanged(
    ca: tuple[PrivateKey, x509.Certificate], b_cert: x509.Certificate
) -> None:
    declared = Deployment(
        id="dep_" + "1" * 26, name="chat", engine="mock", gpus=0, replicas=2, updatedAt=7
    )
    raw = newer_statement(
        declared, KEYS[B], b_cert, priorityClass="batch", nested={"constraints": {"zone": "eu"}}
    )
    here = DeploymentSet()
    (kept,) = plan(RecordsPush(deployments=[msgspec.Raw(raw)]), ca[1], RecordVerifier()).deployments
    assert here.merge([kept], 0) == [kept.fact]
    assert (kept.fact.name, kept.fact.replicas, kept.fact.by) == ("chat", 2, B)
    # Relayed to a third member: the same bytes, and they verify there too.
    (relayed,) = here.kept()
    assert relayed.raw == raw
    onward = plan(RecordsPush(deployments=raws(here.kept())), ca[1], RecordVerifier())
    assert [k.raw for k in onward.deployments] == [raw]


def test_bytes_altered_after_signing_or_a_misplaced_signature_are_refused(
    ca: tuple[PrivateKey, x509.Certificate], b_cert: x509.Certificate
) -> None:
    declared = Deployment(id="dep_" + "2" * 26, name="chat", engine="mock", gpus=0)
    raw = newer_statement(declared, KEYS[B], b_cert, priorityClass="batch")
    signature = msgspec.json.decode(raw, type=Deployment).signature
    forged = [
        raw.replace(b'"priorityClass":"batch"', b'"priorityClass":"interactive"'),  # unknown
        raw.replace(b'"replicas":1', b'"replicas":9'),  # known
        raw.replace(b"}", b',"signature":"' + signature.encode() + b'"}'),  # twice
        raw.replace(b'"signature":"', b'"signature" : "'),  # not as the signer wrote it
    ]
    verifier = RecordVerifier()
    result = plan(RecordsPush(deployments=[msgspec.Raw(f) for f in forged]), ca[1], verifier)
    assert result.deployments == ()
    assert len(result.refused) == len(forged)
    # The control: the bytes as signed are taken.
    (taken,) = plan(RecordsPush(deployments=[msgspec.Raw(raw)]), ca[1], verifier).deployments
    assert taken.raw == raw


def test_one_piece_that_does_not_decode_is_refused_alone(
    ca: tuple[PrivateKey, x509.Certificate],
) -> None:
    good = newer_record(node_record(B, 9), KEYS[B])
    bad = [b'{"nodeId":1}', b"[]", b'{"nodeId":"' + B.encode() + b'","generation":"x"}']
    result = plan(
        RecordsPush(records=[msgspec.Raw(r) for r in (*bad, good)]), ca[1], RecordVerifier()
    )
    assert [k.raw for k in result.offers] == [good]
    assert sum("does not decode" in why for why in result.refused) == len(bad)
    assert not any(B in why for why in result.refused)  # what was wrong, never what it held


def test_the_payload_is_the_bytes_with_the_signature_emptied_and_nothing_else() -> None:
    assert signed_payload(b'{"a":1,"signature":"c2ln"}', "c2ln") == b'{"a":1,"signature":""}'
    assert signed_payload(b'{"signature":"c2ln","x":{"signature":"c2ln"}}', "c2ln") is None
    assert signed_payload(b'{"a":1,"signature":"c2ln"}', "other") is None
    assert signed_payload(b'{"a":1}', "\u00e9") is None


def test_what_this_release_makes_is_its_own_encoding() -> None:
    record = node_record(B, 3)
    assert Kept.made(record).raw == msgspec.json.encode(record)
    assert msgspec.json.decode(bytes(raws([record])[0]), type=NodeRecord) == record
