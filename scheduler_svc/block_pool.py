"""KV block bookkeeping: the blocks, the LRU free queue and the prefix-cache hash map.

Mechanism only; which blocks a request gets is the KVCacheManager's policy.

Every block is in exactly one of these states:

    in use       ref_cnt > 0, not in the free queue (held by ref_cnt block tables)
    cached-free  ref_cnt == 0, in the free queue, still has a hash: a later
                 request with the same prefix can take it back (touch)
    free         ref_cnt == 0, in the free queue, no hash

Invariant: block.block_hash is not None  <=>  cached_blocks[block.block_hash] is block.
Block 0 is the null block: the executor pads block tables with it, so it is
never handed out and never enters the free queue.

The free queue is in eviction order: get_new_blocks pops from the head
(least recently freed first), free_blocks appends at the tail.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

# name -> function(data) returning a hashlib object with 32-byte digest()
HASH_ALGOS: dict[str, Callable[[bytes], Any]] = {
    "sha256": hashlib.sha256,
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32),
}

_NO_EXTRA = struct.pack("<I", 0)


@functools.cache
def _int64s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def hash_block_tokens(
    hash_fn: Callable[[bytes], Any],
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: bytes | None = None,
) -> bytes:
    """Hash of one full block: chains the parent's hash, so equal hashes mean equal prefixes.

    Canonical, process-independent encoding (never Python's hash()):
        b"\\x00" (no parent) or b"\\x01" + parent | len(extra) u32 + extra | token ids, int64 little-endian
    Every part but the last has a known length, so distinct inputs never
    encode to the same bytes.
    """
    head = b"\x00" if parent_hash is None else b"\x01" + parent_hash
    extra = _NO_EXTRA if not extra_keys else struct.pack("<I", len(extra_keys)) + extra_keys
    return hash_fn(head + extra + _int64s(len(token_ids)).pack(*token_ids)).digest()


class KVCacheBlock:
    """One KV block's metadata; created once per block id, never reallocated."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Free-queue links; both None exactly when the block is not in the queue.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

        head <-> b3 <-> b7 <-> b1 <-> tail      (head and tail are sentinels)

    popleft, append and remove (from anywhere) are O(1) and allocate nothing.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev
        self.num_free_blocks = len(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already free"
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, hash_algo: str = "sha256") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {sorted(HASH_ALGOS)}, got {hash_algo!r}")
        self.num_blocks = num_blocks  # including the null block
        self.enable_caching = enable_caching
        self.hash_fn = HASH_ALGOS[hash_algo]
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self._num_cached_free = 0

    # -- counts -------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.free_block_queue.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    # -- allocation ---------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes num_blocks from the head of the free queue, evicting their cached prefixes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Prefix-cache hit: one more table holds each block; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One table less holds each block; blocks nobody holds join the queue tail in the given order.

        Callers pass a request's blocks tail-first, so its tail blocks (the
        least shareable) are evicted before its head blocks.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    # -- prefix cache -------------------------------------------------------

    def hash_block(self, parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: bytes | None = None) -> bytes:
        return hash_block_tokens(self.hash_fn, parent_hash, token_ids, extra_keys)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Registers a block (now full, held by a request) under block_hash; True if it was.

        If another block already holds the same prefix (two requests computed
        it side by side), the first one stays cached and this block stays
        unhashed.
        """
        assert self.enable_caching, "cache_full_block called with prefix caching disabled"
        assert block.ref_cnt > 0, f"caching block {block.block_id} that nobody holds"
        assert block.block_hash is None, f"block {block.block_id} is already cached"
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drops the block's hash (its content is not what the hash promises); no-op if unhashed."""
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
        if block.ref_cnt == 0:
            self._num_cached_free -= 1

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, e.g. after the executor lost its KV memory."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self._num_cached_free = 0
