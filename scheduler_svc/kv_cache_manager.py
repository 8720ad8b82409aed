"""KV cache policy over the block pool: prefix hits, allocation, admission headroom, freeing.

A request's block table covers exactly the tokens whose KV is computed or
being computed this step, so at most its last block is partially filled:

    block_size = 4, 10 tokens, 7 computed, 2 scheduled this step
    tokens:  [t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..]
    blocks:  [    b5      |     b2      |    b9      ]   cdiv(7 + 2, 4) = 3 blocks
              full,cached   full after this step -> cached at allocation
                                         partial  -> no hash yet

A block is registered in the prefix cache as soon as it will be full after the
step being planned: the executor writes the KV of the whole step before any
attention runs, so another request admitted in the same step may already hit
it. If that step never runs (its plan was undone, or it failed), the hashes
registered for it must be dropped again (uncache_blocks_from / uncache).

A block whose last token is a pending sample (overlap scheduling) cannot be
hashed when its step is planned; it is registered when that sample arrives
(cache_block_completed_by_last_token), while the step writing it may still
run. Any plan that could hit it runs after that step, and the entry is filed
under that step, so its failure drops it like the step's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.request import Request


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        watermark_blocks: int = 0,
        hash_algo: str = "sha256",
    ) -> None:
        # Validated where they are declared (scheduler_config.py).
        assert block_size >= 1 and watermark_blocks >= 0, (block_size, watermark_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, hash_algo)
        # Admissions must leave this many blocks free, so running requests can
        # keep growing for a while before anyone is preempted.
        self.watermark_blocks = watermark_blocks
        self.prefix_cache_queries = 0  # tokens looked up at admissions
        self.prefix_cache_hits = 0  # of those, tokens found cached
        # (block id, hash) registered since the last pop_newly_cached().
        self._newly_cached: list[tuple[int, bytes]] = []

    # -- stats --------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.block_pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.block_pool.num_used_blocks / self.block_pool.num_total_blocks

    # -- prefix cache -------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached block-aligned prefix of the request's tokens: (blocks, num tokens).

        The last token is always recomputed (its logits give the next token),
        so a fully cached 32-token prompt with block_size 16 hits 16 tokens.
        Takes no reference: pass the blocks to allocate_slots in the same step.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            if i == len(hashes):
                self._hash_blocks_up_to(request, i + 1)
            block = pool.get_cached_block(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _hash_blocks_up_to(self, request: Request, num_blocks: int) -> None:
        """Extends request.block_hashes to its first num_blocks (full) blocks."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        assert num_blocks * bs <= len(tokens), f"request {request.request_id!r}: hashing a block that is not full"
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = self.block_pool.hash_block(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)

    # -- allocation ---------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        *,
        is_admission: bool,
    ) -> list[int] | None:
        """Extends the block table so num_new_tokens more tokens can be computed.

            tokens: | num_computed_tokens | num_new_computed_tokens | num_new_tokens |
            blocks: | request.block_ids   | new_computed_blocks     | new blocks     |

        new_computed_blocks are prefix hits from get_computed_blocks (admissions
        only). Admissions are refused unless watermark_blocks stay free
        afterwards. Returns the block ids appended to the table (possibly
        none), or None if there is not enough free memory (nothing changes).
        """
        if num_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: num_new_tokens must be >= 1, got {num_new_tokens}")
        bs = self.block_size
        block_ids = request.block_ids
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_planned_tokens, (
            f"request {request.request_id!r}: scheduling {num_total} tokens, only {request.num_planned_tokens} "
            "known or pending"
        )
        # Blocks full of known tokens after this step; one ending in a pending sample waits for it.
        num_full = min(num_total, request.num_tokens) // bs
        if not new_computed_blocks and num_total <= len(block_ids) * bs:
            # Fast path (most decode steps): the held blocks have room.
            if self.enable_caching and num_full > num_computed // bs:
                self._newly_cached += self._cache_full_blocks(request, num_computed // bs, num_full)
            return []

        pool = self.block_pool
        num_new_blocks = (num_total + bs - 1) // bs - len(block_ids) - len(new_computed_blocks)
        assert num_new_blocks >= 0, f"request {request.request_id!r} holds more blocks than its tokens need"
        # Reviving a cached-free hit takes it out of the free queue as well.
        num_needed = num_new_blocks + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if is_admission:
            assert not block_ids, f"admitting request {request.request_id!r} that still holds blocks"
            num_needed += self.watermark_blocks
        if num_needed > pool.free_block_queue.num_free_blocks:
            return None

        if is_admission and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        new_ids = []
        if new_computed_blocks:
            pool.touch(new_computed_blocks)  # before get_new_blocks, which could evict them
            new_ids = [b.block_id for b in new_computed_blocks]
        if num_new_blocks:
            new_ids += [b.block_id for b in pool.get_new_blocks(num_new_blocks)]
        block_ids += new_ids
        if self.enable_caching and num_full > num_computed // bs:
            self._newly_cached += self._cache_full_blocks(request, num_computed // bs, num_full)
        return new_ids

    def cache_block_completed_by_last_token(self, request: Request) -> list[tuple[int, bytes]]:
        """A sample just arrived; if it fills a block that a planned step computes, register that block.

        Only overlap scheduling gets here: a step was planned over the
        sample's position before its id was known, so allocation could not
        hash the block then. Returns the (block id, hash) registered, which
        the caller files under the step in flight that writes the block.
        """
        n = request.num_tokens
        if self.enable_caching and n % self.block_size == 0 and request.num_computed_tokens >= n:
            return self._cache_full_blocks(request, n // self.block_size - 1, n // self.block_size)
        return []

    def _cache_full_blocks(self, request: Request, first: int, end: int) -> list[tuple[int, bytes]]:
        """Registers blocks [first, end) of the request, which are full after this step.

        Blocks before `first` were full when earlier steps were planned (or
        are prefix hits) and went through here then. Returns what it registered.
        """
        self._hash_blocks_up_to(request, end)
        pool = self.block_pool
        registered = []
        for i in range(first, end):
            block = pool.blocks[request.block_ids[i]]
            if pool.cache_full_block(block, request.block_hashes[i]):
                registered.append((block.block_id, block.block_hash))
        return registered

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []

    # -- undoing cache entries whose KV was never written ---------------------

    def uncache_blocks_from(self, request: Request, num_valid_tokens: int) -> None:
        """Drops the hashes of the request's blocks holding any token at position >= num_valid_tokens.

        For a request whose allocation in the step being planned is undone:
        those blocks were registered as if the step would run.
        """
        blocks = self.block_pool.blocks
        for block_id in request.block_ids[num_valid_tokens // self.block_size :]:
            self.block_pool.uncache_block(blocks[block_id])

    def pop_newly_cached(self) -> list[tuple[int, bytes]]:
        """(block id, hash) pairs registered since the last call: what one planned step caches."""
        entries, self._newly_cached = self._newly_cached, []
        return entries

    def uncache(self, entries: Sequence[tuple[int, bytes]]) -> None:
        """Drops the hashes a failed step registered (their KV is garbage) unless already gone."""
        blocks = self.block_pool.blocks
        for block_id, block_hash in entries:
            block = blocks[block_id]
            if block.block_hash == block_hash:
                self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (the executor lost its KV memory)."""
        self.block_pool.reset_prefix_cache()
        self._newly_cached.clear()
