"""Artifacts' manifests and facts (`facts.artifacts`, issue 28): the digest names the bytes,
a manifest that could place a file outside its folder or whose pieces do not add up is
refused, pieces are laid out file by file, and a fact describes only its own manifest."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest

from certs import new_node_id
from certs.identity import issue_node_cert, make_ca, new_key
from facts.artifacts import (
    Artifact,
    ArtifactSet,
    Held,
    Manifest,
    ManifestFile,
    bad_path,
    evictions,
    manifest_digest,
    pieces,
)
from facts.kept import raws
from facts.membership import plan_push
from facts.record_signing import RecordVerifier, sign_statement
from facts.records import RecordsPush

KIB = 64 * 1024  # the smallest piece size a manifest may have


def h(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def manifest(*files: tuple[str, int], piece_size: int = KIB) -> Manifest:
    return Manifest(
        pieceSize=piece_size,
        files=[
            ManifestFile(path=p, size=s, pieces=[h(f"{p}{n}") for n in range(-(-s // piece_size))])
            for p, s in files
        ],
    )


def test_the_digest_names_every_byte_of_the_manifest() -> None:
    base = manifest(("config.json", 10), ("model.safetensors", 3 * KIB + 1))
    assert manifest_digest(base) == manifest_digest(
        manifest(("config.json", 10), ("model.safetensors", 3 * KIB + 1))
    )
    assert manifest_digest(base).startswith("sha256:")
    changed = [
        manifest(("config.json", 11), ("model.safetensors", 3 * KIB + 1)),
        manifest(("config.jsom", 10), ("model.safetensors", 3 * KIB + 1)),
        manifest(("config.json", 10), ("model.safetensors", 3 * KIB + 1), piece_size=2 * KIB),
        msgspec.structs.replace(
            base,
            files=[
                base.files[0],
                msgspec.structs.replace(base.files[1], pieces=[h("x"), *base.files[1].pieces[1:]]),
            ],
        ),
    ]
    assert len({manifest_digest(m) for m in (base, *changed)}) == 1 + len(changed)


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../up", "a/../../b", "a//b", "./a", "a/.", "", "a\\b", "a\x00b", "a/"],
)
def test_a_path_that_could_leave_the_folder_is_refused(path: str) -> None:
    assert bad_path(path) is not None
    assert bad_path("snapshots/abc/model-00001-of-00002.safetensors") is None  # the control


def test_a_manifest_whose_files_or_pieces_do_not_add_up_is_refused() -> None:
    good = manifest(("a", KIB), ("b", 0), ("c/d", 2 * KIB + 5))
    assert good.why_not() is None
    assert (good.size, good.piece_count) == (3 * KIB + 5, 1 + 0 + 3)
    unsorted = msgspec.structs.replace(good, files=list(reversed(good.files)))
    twice = msgspec.structs.replace(good, files=[good.files[0], good.files[0]])
    short = msgspec.structs.replace(
        good,
        files=[
            *good.files[:2],
            msgspec.structs.replace(good.files[2], pieces=good.files[2].pieces[:2]),
        ],
    )
    escaping = manifest(("../x", 1))
    for bad, why in (
        (unsorted, "sorted"),
        (twice, "sorted"),
        (short, "2 pieces"),
        (escaping, "'..'"),
    ):
        said = bad.why_not()
        assert said is not None
        assert why in said


def test_a_manifest_with_a_malformed_hash_does_not_decode() -> None:
    raw = msgspec.json.encode(manifest(("a", 1)))
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw.replace(b'"]]', b'X"]]'), type=Manifest)
    assert msgspec.json.decode(raw, type=Manifest) == manifest(("a", 1))  # the control


def test_pieces_are_laid_out_file_by_file_the_last_one_shorter() -> None:
    laid = list(pieces(manifest(("a", KIB), ("b", 0), ("c", 2 * KIB + 5))))
    assert [(p.index, p.file, p.offset, p.length) for p in laid] == [
        (0, 0, 0, KIB),
        (1, 2, 0, KIB),
        (2, 2, KIB, KIB),
        (3, 2, 2 * KIB, 5),
    ]


def test_a_fact_describes_only_its_own_manifest() -> None:
    mine = manifest(("a", 3 * KIB))
    fact = Artifact(
        id="art_" + "0" * 26,
        name="llama",
        digest=manifest_digest(mine),
        size=mine.size,
        pieceSize=mine.pieceSize,
        files=1,
        pieceCount=mine.piece_count,
    )
    assert fact.describes(mine)
    assert not fact.describes(manifest(("a", 3 * KIB - 1)))
    assert not msgspec.structs.replace(fact, size=1).describes(mine)


def test_a_forget_is_a_tombstone_that_wins_over_older_versions() -> None:
    held = ArtifactSet()
    added = Artifact(id="art_" + "1" * 26, name="llama", digest="sha256:" + "a" * 64, updatedAt=5)
    forgotten = msgspec.structs.replace(added, deleted=True, version=2, updatedAt=9)
    assert held.merge([forgotten, added], 0) == [forgotten]
    assert held.live() == []
    assert held.get("llama") == forgotten


def test_an_artifact_fact_is_taken_only_as_a_members_signed_statement() -> None:
    ca_key, ca_cert = make_ca("lab")
    node, key = new_node_id(), new_key()
    cert = issue_node_cert(
        ca_key=ca_key, ca_cert=ca_cert, public_key=key.public_key(), node_id=node, name="b"
    )
    mine = Artifact(id="art_" + "2" * 26, name="llama", digest="sha256:" + "b" * 64, size=10)
    signed = sign_statement(mine, key, cert)
    forged = [
        mine,  # unsigned
        msgspec.structs.replace(signed, digest="sha256:" + "c" * 64),  # other weights
        msgspec.structs.replace(signed, name="mistral"),  # another name
    ]

    def taken(*facts: Artifact) -> list[Artifact]:
        wire = msgspec.json.encode(RecordsPush(artifacts=raws(facts)))
        plan = plan_push(
            msgspec.json.decode(wire, type=RecordsPush),
            self_id=new_node_id(),
            ca=ca_cert,
            is_member=lambda _: True,
            is_removed=lambda _: False,
            key_of=lambda _: None,
            verifier=RecordVerifier(),
            now_ms=int(time.time() * 1000),
        )
        return [k.fact for k in plan.artifacts]

    assert taken(*forged) == []
    assert taken(signed) == [signed]  # the control


def test_eviction_drops_the_least_recently_used_and_never_what_is_kept() -> None:
    held = [Held("sha256:a", 40, 1.0), Held("sha256:b", 30, 2.0), Held("sha256:c", 20, 3.0)]
    assert evictions(held, budget=0, needed=10**12, keep=set()) == []  # no budget
    assert evictions(held, budget=100, needed=10, keep=set()) == []  # it fits
    assert evictions(held, budget=100, needed=20, keep=set()) == ["sha256:a"]
    assert evictions(held, budget=100, needed=20, keep={"sha256:a"}) == ["sha256:b"]
    assert evictions(held, budget=100, needed=60, keep=set()) == ["sha256:a", "sha256:b"]
    assert evictions(held, budget=100, needed=60, keep={"sha256:b"}) == ["sha256:a", "sha256:c"]
    assert evictions(held, budget=100, needed=60, keep={"sha256:b", "sha256:c"}) is None
    assert evictions(held, budget=50, needed=51, keep=set()) is None  # bigger than the budget
