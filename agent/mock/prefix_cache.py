"""The mock engine's prefix cache, modelled (issue 29, item 1): what an engine with prefix
caching reuses of a prompt, so that routing for cache hits can be measured without a GPU.
Pure: no I/O, no clock.

A prompt is a sequence of units (the mock's "tokens": words). As vLLM does, it is cut into
blocks of `block` units, and each full block is named by a hash chained over every block
before it: a block's name says the whole prefix up to it, so two prompts share a cached
block only when they share everything before it too. The cache is an LRU of at most
`capacity` block names. A prompt's cached units are the full blocks of its longest prefix
whose every block is cached; then all its full blocks are cached (the most recently used
last). The counters are vLLM's: units queried and units hit, cumulative.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["PrefixCache", "block_names"]


def block_names(units: Sequence[str], block: int) -> list[bytes]:
    """The chained names of the full blocks of `units` (a partial last block has none)."""
    names: list[bytes] = []
    parent = b""
    for start in range(0, len(units) - block + 1, block):
        digest = hashlib.blake2b(parent, digest_size=16)
        for unit in units[start : start + block]:
            digest.update(unit.encode("utf-8", "surrogatepass"))
            digest.update(b"\x00")
        parent = digest.digest()
        names.append(parent)
    return names


@dataclass
class PrefixCache:
    """An engine's cache of prompt blocks."""

    capacity: int  # blocks it holds at most (0: no cache: nothing is ever reused)
    block: int = 16  # units per block
    queries: int = 0  # prompt units looked up, cumulative
    hits: int = 0  # of those, units found cached
    _blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.block < 1 or self.capacity < 0:
            raise ValueError(f"block {self.block} must be at least 1, capacity at least 0")

    def admit(self, units: Sequence[str]) -> int:
        """A prompt arrives: how many of its units are cached (its longest cached prefix of
        whole blocks); its blocks are cached from now on."""
        names = block_names(units, self.block)
        matched = 0
        for name in names:
            if name not in self._blocks:
                break
            matched += 1
        cached = matched * self.block
        self.queries += len(units)
        self.hits += cached
        if self.capacity:
            for name in names:
                self._blocks[name] = None
                self._blocks.move_to_end(name)
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        return cached

    @property
    def used(self) -> float:
        """The share of the cache's blocks in use (0 to 1; 0 without a cache)."""
        return len(self._blocks) / self.capacity if self.capacity else 0.0
