"""The packed allowed-token bitmask that crosses the step protocol.

One row per constrained request: little-endian uint32 words, bit (t % 32) of
word (t // 32) set = token t may be sampled, so a row is
4 * ceil(vocab_size / 32) bytes (6,144 for a 49,152-token vocabulary). This is
llguidance's and xgrammar's layout, so the scheduler forwards the grammar
library's mask as it is. Read as bytes, bit (t % 8) of byte (t // 8) is token t.
"""

from __future__ import annotations

from collections.abc import Iterable


def mask_width_bytes(vocab_size: int) -> int:
    return 4 * ((vocab_size + 31) // 32)


def pack_allowed(token_ids: Iterable[int], vocab_size: int) -> bytes:
    """The row allowing exactly `token_ids`."""
    row = bytearray(mask_width_bytes(vocab_size))
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} outside [0, {vocab_size})")
        row[t >> 3] |= 1 << (t & 7)
    return bytes(row)


def unpack_allowed(row: bytes, vocab_size: int) -> list[int]:
    """The token ids a row allows (bits past vocab_size ignored)."""
    return [t for t in range(min(vocab_size, 8 * len(row))) if row[t >> 3] >> (t & 7) & 1]
