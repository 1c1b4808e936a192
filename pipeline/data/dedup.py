"""Duplicate detection for prompt streams in fixed memory.

- Exact duplicates: the 64-bit prefix of the conversation's content hash, kept in a set (8 bytes of
  payload per kept conversation, never the text).
- Near duplicates: MinHash over word 5-gram shingles of the normalized prompt text, banded (LSH); a
  conversation is a near duplicate when any of its band hashes was seen before. Seen band hashes
  live in one fixed-size Bloom filter, so memory does not grow with the number of prompts.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

_MERSENNE = np.uint64((1 << 61) - 1)
_WORD = re.compile(r"\w+")


def normalize_text(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


class BloomFilter:
    """A fixed-size set of 64-bit keys with k hash probes; false positives possible, negatives not."""

    def __init__(self, bits: int = 1 << 28, probes: int = 3):
        self.size = bits
        self.array = np.zeros(bits // 8, dtype=np.uint8)
        self.probes = probes

    def _positions(self, keys: np.ndarray) -> np.ndarray:
        keys = keys.astype(np.uint64)
        positions = []
        for probe in range(self.probes):
            mixed = (keys ^ np.uint64(0x9E3779B97F4A7C15 * (probe + 1) & 0xFFFFFFFFFFFFFFFF)) * np.uint64(
                0xBF58476D1CE4E5B9
            )
            positions.append((mixed >> np.uint64(17)) % np.uint64(self.size))
        return np.concatenate(positions)

    def contains_any(self, keys: np.ndarray) -> bool:
        """True when at least one key is (probably) in the set."""
        positions = self._positions(keys).reshape(self.probes, -1)
        present = (self.array[positions >> np.uint64(3)] >> (positions & np.uint64(7)).astype(np.uint8)) & 1
        return bool(present.all(axis=0).any())

    def add(self, keys: np.ndarray) -> None:
        positions = self._positions(keys)
        np.bitwise_or.at(
            self.array, positions >> np.uint64(3), (1 << (positions & np.uint64(7))).astype(np.uint8)
        )


class NearDuplicateFilter:
    """MinHash LSH with `bands` x `rows` permutations; Jaccard 0.8 is caught with probability ~0.9."""

    def __init__(
        self, bands: int = 12, rows: int = 8, shingle: int = 5, bloom_bits: int = 1 << 28, seed: int = 0
    ):
        rng = np.random.default_rng(seed)
        count = bands * rows
        self.a = rng.integers(1, int(_MERSENNE), size=count, dtype=np.uint64)
        self.b = rng.integers(0, int(_MERSENNE), size=count, dtype=np.uint64)
        self.row_weights = rng.integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1)
        self.band_salts = rng.integers(0, 2**63, size=bands, dtype=np.uint64)
        self.bands, self.rows, self.shingle = bands, rows, shingle
        self.seen = BloomFilter(bloom_bits)

    def _shingle_hashes(self, text: str) -> np.ndarray:
        words = normalize_text(text).split()
        if len(words) < self.shingle:
            grams = [" ".join(words)]
        else:
            grams = [" ".join(words[i : i + self.shingle]) for i in range(len(words) - self.shingle + 1)]
        return np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))

    def band_keys(self, text: str) -> np.ndarray:
        shingles = self._shingle_hashes(text)
        # (a*x + b) mod p on 64-bit words; x < 2^32 and a < 2^61 may wrap, which stays a fixed hash family
        permuted = (self.a[:, None] * shingles[None, :] + self.b[:, None]) % _MERSENNE
        signature = permuted.min(axis=1).reshape(self.bands, self.rows)
        # one 64-bit key per band: a random odd-weighted sum of its rows, salted by the band number
        return (signature * self.row_weights).sum(axis=1) ^ self.band_salts

    def check_and_add(self, text: str) -> bool:
        """True when `text` nearly duplicates an earlier one; otherwise it is remembered."""
        keys = self.band_keys(text)
        if self.seen.contains_any(keys):
            return True
        self.seen.add(keys)
        return False


class ExactDuplicateFilter:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def check_and_add(self, sample_id: str) -> bool:
        key = int(sample_id[:16], 16)
        if key in self.seen:
            return True
        self.seen.add(key)
        return False
