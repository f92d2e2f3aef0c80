"""Webster / Sainte-Laguë apportionment (`plane.placement.apportion`): known answers, ties, caps,
and scale changes that move only the delta."""

from __future__ import annotations

import random

from plane.placement.apportion import apportion, min_shares, scale_down, scale_up


def test_known_answers() -> None:
    # Sainte-Laguë's textbook cases (highest averages with divisors 1, 3, 5, ...).
    wide = {"a": 100_000, "b": 80_000, "c": 30_000, "d": 20_000}
    assert apportion(8, wide, dict.fromkeys(wide, 99)) == {"a": 3, "b": 3, "c": 1, "d": 1}
    assert apportion(7, {"a": 53, "b": 24, "c": 23}, {}) == {"a": 3, "b": 2, "c": 2}
    # D'Hondt would give a 4 of 7 here; Webster does not favour the large.
    assert apportion(7, {"a": 53, "b": 24, "c": 23}, {})["a"] != 4


def test_ties_go_to_the_lower_cluster_id_and_order_does_not_matter() -> None:
    assert apportion(3, {"clu_b": 2, "clu_a": 2}, {}) == {"clu_a": 2, "clu_b": 1}
    assert apportion(1, {"clu_b": 5, "clu_a": 5, "clu_c": 5}, {}) == {"clu_a": 1}
    rng = random.Random(7)
    weights = {f"clu_{i:02d}": rng.randint(1, 9) for i in range(30)}
    items = list(weights.items())
    rng.shuffle(items)
    assert apportion(40, dict(items), weights) == apportion(40, weights, weights)


def test_caps_bound_each_share_and_the_total() -> None:
    assert apportion(6, {"a": 10, "b": 1}, {"a": 2, "b": 1}) == {"a": 2, "b": 1}
    assert apportion(5, {"a": 4, "b": 4}, {"a": 4, "b": 1}) == {"a": 4, "b": 1}
    assert apportion(3, {"a": 0, "b": 2}, {}) == {"b": 2}  # weight 0 takes no part
    assert apportion(0, {"a": 3}, {}) == {}


def test_house_monotone_scale_up_moves_only_the_added() -> None:
    current = apportion(5, {"a": 6, "b": 3, "c": 3}, {"a": 6, "b": 3, "c": 3})
    remaining = {
        "a": 6 - current.get("a", 0),
        "b": 3 - current.get("b", 0),
        "c": 3 - current.get("c", 0),
    }
    grown = scale_up(current, 3, remaining)
    assert sum(grown.values()) == 8
    assert all(grown[k] >= n for k, n in current.items())  # nobody loses a replica
    added = {k: grown[k] - current.get(k, 0) for k in grown}
    assert added == apportion(3, remaining, remaining)  # the delta alone, by remaining room
    # A cluster with no room left takes none of the added replicas.
    assert scale_up({"a": 2, "b": 2}, 2, {"a": 0, "b": 5}) == {"a": 2, "b": 4}


def test_scale_down_takes_from_the_largest_and_drops_zero_shares() -> None:
    assert scale_down({"a": 4, "b": 2, "c": 1}, 2) == {"a": 2, "b": 2, "c": 1}
    assert scale_down({"clu_b": 2, "clu_a": 2}, 1) == {"clu_a": 1, "clu_b": 2}
    assert scale_down({"a": 1, "b": 1}, 1) == {"b": 1}  # a 0 share is no share
    assert scale_down({"a": 1}, 5) == {}
    rng = random.Random(3)
    for _ in range(50):
        current = {f"clu_{i}": rng.randint(0, 6) for i in range(rng.randint(1, 8))}
        removed = rng.randint(0, sum(current.values()))
        after = scale_down(current, removed)
        assert sum(after.values()) == sum(current.values()) - removed
        assert all(0 < after[k] <= current[k] for k in after)


def test_a_min_is_shared_over_the_shares_of_the_max_never_past_one() -> None:
    assert min_shares({"a": 2, "b": 1}, 1) == {"a": 1, "b": 0}
    assert min_shares({"a": 2, "b": 2}, 2) == {"a": 1, "b": 1}  # spread, not piled on a
    assert min_shares({"a": 1, "b": 1}, 5) == {"a": 1, "b": 1}  # at most the shares
    rng = random.Random(11)
    for _ in range(500):
        shares = {f"clu_{i}": rng.randint(0, 6) for i in range(rng.randint(1, 6))}
        low = rng.randint(0, sum(shares.values()) + 2)
        given = min_shares(shares, low)
        assert set(given) == set(shares)
        assert all(0 <= given[c] <= shares[c] for c in shares)
        assert sum(given.values()) == min(low, sum(shares.values()))
        assert min_shares(dict(reversed(list(shares.items()))), low) == given  # any order
