"""The serving digest: `svg_` + SHA-256 of the canonical serving configuration (seed 000).

Canonical JSON: keys sorted, no insignificant whitespace, UTF-8, so the same configuration in
any key order has the same digest, and a different configuration (FP8 vs BF16, TP2 vs TP4,
32k vs 128k context) has a different one.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from plane.core.errors import InvalidServingConfig

__all__ = ["serving_digest"]


def serving_digest(config: dict[str, Any]) -> str:
    """`svg_<sha256 hex>` of the canonical form of `config`."""
    _check(config)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "svg_" + hashlib.sha256(canonical.encode()).hexdigest()


def _check(value: Any) -> None:
    # Floats that JSON cannot carry, and keys that are not strings, have no canonical form.
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidServingConfig("a serving configuration cannot hold NaN or infinity")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidServingConfig("serving configuration keys must be strings")
            _check(item)
    elif isinstance(value, list):
        for item in value:
            _check(item)
