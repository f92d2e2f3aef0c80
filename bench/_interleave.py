"""Run a baseline and a subject alternately and report medians and their ratio (STYLE.md)."""

from __future__ import annotations

import statistics
from collections.abc import Callable


def interleave(
    baseline: Callable[[], float],
    subject: Callable[[], float],
    *,
    rounds: int = 7,
    unit: str = "ops/s",
    label: str = "",
) -> float:
    """A B A B ... `rounds` times; each callable returns a rate. Prints and returns the ratio."""
    base_rates: list[float] = []
    subject_rates: list[float] = []
    for _ in range(rounds):
        base_rates.append(baseline())
        subject_rates.append(subject())
    return report(base_rates, subject_rates, unit=unit, label=label)


def report(
    base_rates: list[float], subject_rates: list[float], *, unit: str, label: str = ""
) -> float:
    """Print both medians with every round, then `ratio: X.XX` (subject / baseline)."""
    base = statistics.median(base_rates)
    subj = statistics.median(subject_rates)
    ratio = subj / base
    prefix = f"{label} " if label else ""
    print(f"{prefix}baseline median: {base:,.0f} {unit}  (rounds: {_fmt(base_rates)})")
    print(f"{prefix}subject  median: {subj:,.0f} {unit}  (rounds: {_fmt(subject_rates)})")
    print(f"ratio: {ratio:.2f}")
    return ratio


def _fmt(rates: list[float]) -> str:
    return " ".join(f"{rate:,.0f}" for rate in rates)
