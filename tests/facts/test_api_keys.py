"""API keys as signed, converging cluster facts (`facts.api_keys`), and how a records push
takes them (`facts.membership.plan_push`)."""

from __future__ import annotations

import itertools
import time

import msgspec
import pytest

from certs import new_node_id
from certs.identity import issue_node_cert, make_ca, new_key
from facts.api_keys import (
    MAX_KEYS,
    SECRET_PREFIX,
    ApiKey,
    KeySet,
    fingerprint,
    hash_secret,
    hashes_match,
    new_secret,
)
from facts.kept import raws
from facts.membership import plan_push
from facts.record_signing import RecordVerifier, sign_statement
from facts.records import RecordsPush, push_decoder

NOW = 1_000_000


def version(n: int, at: int, by: str, **fields: object) -> ApiKey:
    base = ApiKey(name="team-a", keyHash="a" * 64, version=n, updatedAt=at, by=by)
    return msgspec.structs.replace(base, **fields)


def test_a_secret_is_kept_as_its_hash_only() -> None:
    secret = new_secret()
    assert secret.startswith(SECRET_PREFIX)
    assert len(secret) > len(SECRET_PREFIX) + 40
    assert new_secret() != secret
    digest = hash_secret(secret)
    assert len(digest) == 64
    assert secret not in digest
    assert hashes_match(digest, hash_secret(secret))
    assert not hashes_match(digest, hash_secret(secret + "x"))
    assert fingerprint(digest) == digest[:8]
    with pytest.raises(msgspec.ValidationError):  # a secret where the hash goes
        msgspec.convert({"name": "x", "keyHash": secret}, ApiKey)


def test_expiry_models_and_revocation_decide_use() -> None:
    key = version(1, 0, "nod_a", expiresAt=NOW + 1, models=["m1"])
    assert key.usable(NOW)
    assert not key.usable(NOW + 1)
    assert key.allows("m1")
    assert not key.allows("m2")
    assert version(1, 0, "nod_a").allows("anything")  # no models listed: every model
    assert version(1, 0, "nod_a", expiresAt=0).usable(10**15)  # never expires
    assert not version(2, 0, "nod_a", revoked=True, keyHash="").usable(NOW)


def test_concurrent_edits_converge_to_one_version_in_any_order() -> None:
    edits = [
        version(3, 100, "nod_a", rpm=3),
        version(4, 200, "nod_a", rpm=4),
        version(4, 200, "nod_b", rpm=1),  # same version and time: the node id decides
        version(4, 150, "nod_c", rpm=9),
    ]
    outcomes = set()
    for order in itertools.permutations(edits):
        held = KeySet()
        for k in order:
            held.offer(k, NOW)
        outcomes.add(msgspec.json.encode(held.all()))
    assert outcomes == {msgspec.json.encode([edits[2]])}


def test_a_revocation_is_not_undone_by_a_late_older_version() -> None:
    held = KeySet()
    assert held.offer(version(1, 10, "nod_a"), NOW)
    assert held.offer(version(2, 20, "nod_b", revoked=True, keyHash=""), NOW)
    assert not held.offer(version(1, 10, "nod_a"), NOW)  # a late copy of the live one
    assert held.get("team-a") == version(2, 20, "nod_b", revoked=True, keyHash="")
    assert held.next_version("team-a") == 3  # a new key of that name outranks the tombstone


def test_the_set_is_bounded_expired_then_old_tombstones_go_first() -> None:
    held = KeySet()
    for i in range(MAX_KEYS):
        held.offer(version(1, i, "nod_a", name=f"k{i}", revoked=i in (5, 6)), NOW)
    held.offer(version(2, 0, "nod_a", name="k9", expiresAt=NOW - 1), NOW)
    assert not held.full(NOW)
    assert held.offer(version(1, 999, "nod_a", name="new1"), NOW)
    assert held.get("k9") is None  # the expired one went first
    assert held.offer(version(1, 999, "nod_a", name="new2"), NOW)
    assert held.get("k5") is None
    assert held.get("k6") is not None
    assert held.offer(version(1, 999, "nod_a", name="new3"), NOW)
    assert held.full(NOW)
    assert not held.offer(version(1, 1000, "nod_a", name="new4"), NOW)  # live keys stay
    assert len(held.all()) == MAX_KEYS


def test_a_forged_key_is_refused_and_a_members_own_is_taken() -> None:
    ca_key, ca_cert = make_ca("lab")
    key, node_id = new_key(), new_node_id()
    cert = issue_node_cert(
        ca_key=ca_key, ca_cert=ca_cert, public_key=key.public_key(), node_id=node_id, name="b"
    )
    signed = sign_statement(version(1, NOW, "", models=["m1"], rpm=5), key, cert)
    forged = [
        version(1, NOW, node_id),  # unsigned
        msgspec.structs.replace(signed, by=new_node_id()),  # its signature, another's name
        msgspec.structs.replace(signed, models=[], rpm=0),  # widened after signing
        msgspec.structs.replace(signed, keyHash=hash_secret("sk-attacker")),  # another secret
    ]
    verifier = RecordVerifier()

    def taken(*keys: ApiKey) -> tuple[ApiKey, ...]:
        push = push_decoder.decode(msgspec.json.encode(RecordsPush(apiKeys=raws(list(keys)))))
        kept = plan_push(
            push,
            self_id=new_node_id(),
            ca=ca_cert,
            is_member=lambda _: True,
            is_removed=lambda _: False,
            key_of=lambda _: None,
            verifier=verifier,
            now_ms=int(time.time() * 1000),
        ).api_keys
        return tuple(k.fact for k in kept)

    assert taken(*forged) == ()
    assert verifier.refused == len(forged)
    assert taken(signed) == (signed,)  # the control
    other_ca = make_ca("elsewhere")[1]
    assert verifier.statement_why_not(signed, other_ca, "an API key") is not None
