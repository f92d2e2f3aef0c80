"""Plane ids, the serving digest and enrolment tokens (no database)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plane.core.digest import serving_digest
from plane.core.ids import PREFIXES, InvalidId, is_id, new_id, validate_id
from plane.core.tokens import hash_token, mint_token, token_cluster, token_matches


@pytest.mark.parametrize("prefix", sorted(PREFIXES))
def test_every_prefix_mints_valid_ids(prefix: str) -> None:
    minted = new_id(prefix)
    assert minted.startswith(prefix + "_")
    assert minted == minted.lower()
    assert validate_id(minted, prefix) == minted
    other = next(p for p in PREFIXES if p != prefix)
    assert not is_id(minted, other)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "clu_",
        "CLU_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "clu_01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "xyz_01arz3ndektsv4rrffq69g5fav",
        "clu_01arz3ndektsv4rrffq69g5fa",
        "clu_01arz3ndektsv4rrffq69g5fau",
    ],
)
def test_malformed_ids_are_refused_clearly(bad: str) -> None:
    with pytest.raises(InvalidId, match="is not a Cluster id"):
        validate_id(bad, "clu")


def test_the_nodes_ids_of_the_agent_are_plane_ids() -> None:
    from certs import new_node_id

    assert is_id(new_node_id(), "nod")


config_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


@given(st.dictionaries(st.text(max_size=8), config_values, max_size=6))
def test_digest_ignores_key_order(config: dict[str, object]) -> None:
    reordered = dict(reversed(list(config.items())))
    assert serving_digest(config) == serving_digest(reordered)


def test_digest_tells_serving_configurations_apart() -> None:
    fp8 = {"engine": "vllm", "quantization": "fp8", "tensorParallel": 2, "context": 32768}
    bf16 = {**fp8, "quantization": "bf16", "tensorParallel": 4, "context": 131072}
    assert serving_digest(fp8) != serving_digest(bf16)
    assert serving_digest(fp8).startswith("svg_")
    assert len(serving_digest(fp8)) == 4 + 64
    with pytest.raises(ValueError, match="NaN"):
        serving_digest({"x": float("nan")})


def test_tokens() -> None:
    cluster = new_id("clu")
    token = mint_token(cluster)
    assert token.startswith("hgro1.")
    assert token_cluster(token) == cluster
    stored = hash_token(token)
    assert token not in stored
    assert token_matches(token, stored)
    assert not token_matches(token + "x", stored)
    for bad in ("hgro2." + token[6:], "hgro1.clu_bad.secret", "hgro1." + cluster + ".short"):
        assert token_cluster(bad) is None
