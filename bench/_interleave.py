"""Run a baseline and a subject alternately and report medians and their ratio (STYLE.md).

The machines here change speed by up to 2x within a run. So rounds are paired: each round
measures both, in alternating order (A B, B A, A B, ...), so a drift in speed hits both
sides of a pair alike, and the ratio printed is the median of the per-round ratios. The
medians of both sides are printed too, with every round, so a reader can check.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleave(
    baseline: Callable[[], float],
    subject: Callable[[], float],
    *,
    rounds: int = 9,
    unit: str = "ops/s",
    label: str = "",
) -> float:
    """`rounds` paired rounds; each callable returns a rate. Prints and returns the ratio."""
    base_rates: list[float] = []
    subject_rates: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            base_rates.append(baseline())
            subject_rates.append(subject())
        else:
            subject_rates.append(subject())
            base_rates.append(baseline())
    return report(base_rates, subject_rates, unit=unit, label=label)


def report(
    base_rates: list[float], subject_rates: list[float], *, unit: str, label: str = ""
) -> float:
    """Print both medians with every round, then `ratio: X.XX` (subject / baseline)."""
    ratios = [s / b for b, s in zip(base_rates, subject_rates, strict=True)]
    ratio = statistics.median(ratios)
    prefix = f"{label} " if label else ""
    for side, rates in (("baseline", base_rates), ("subject ", subject_rates)):
        median = statistics.median(rates)
        print(f"{prefix}{side} median: {median:,.0f} {unit}  (rounds: {_fmt(rates)})")
    print(f"{prefix}per-round ratios: {' '.join(f'{r:.2f}' for r in ratios)}")
    print(f"ratio: {ratio:.2f}")
    return ratio


def _fmt(rates: list[float]) -> str:
    return " ".join(f"{rate:,.0f}" for rate in rates)
