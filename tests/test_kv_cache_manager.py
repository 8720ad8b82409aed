"""KVCacheManager: prefix hits, allocation, watermark, freeing order, cache undo.

Block size 4 throughout; blocks are numbered as the pool hands them out.
"""

from __future__ import annotations

import pytest

from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request
from shared.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int = 11, **kwargs) -> KVCacheManager:
    return KVCacheManager(BS, num_blocks, **kwargs)


def make_request(rid: str, tokens: list[int], max_tokens: int = 16) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=max_tokens)


def admit(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int] | None:
    """Admits like the scheduler: prefix hit, then the remaining (or num_tokens) tokens."""
    blocks, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_tokens is None else num_tokens
    ids = kv.allocate_slots(req, num_new, blocks, num_hit, is_admission=True)
    if ids is not None:
        req.num_computed_tokens = num_hit + num_new
    return ids


def decode(kv: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step: the sampled token arrives, then its KV gets a slot."""
    req.append_output_token(token)
    ids = kv.allocate_slots(req, 1, is_admission=False)
    if ids is not None:
        req.num_computed_tokens += 1
    return ids


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue]


def ref_cnts(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.block_pool.blocks[i].ref_cnt for i in ids]


def is_cached(kv: KVCacheManager, block_id: int) -> bool:
    block = kv.block_pool.blocks[block_id]
    return block.block_hash is not None and kv.block_pool.cached_blocks[block.block_hash] is block


def test_prefill_allocates_covering_blocks_and_caches_full_ones():
    kv = make_manager()
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(a) == ([], 0)
    assert admit(kv, a) == [1, 2, 3]
    assert a.block_ids == [1, 2, 3]
    assert [is_cached(kv, i) for i in (1, 2, 3)] == [True, True, False]
    assert len(a.block_hashes) == 2
    assert free_ids(kv) == list(range(4, 11))


def test_prefix_hit_shares_blocks_and_free_order_is_tail_first():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_hit == 8
    assert kv.allocate_slots(b, 3, blocks, num_hit, is_admission=True) == [1, 2, 4]
    assert ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10]

    kv.free(a)
    assert a.block_ids == []
    assert ref_cnts(kv, [1, 2, 3]) == [1, 1, 0]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 3]
    kv.free(b)
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1], "tail blocks must be evicted before head blocks"
    assert kv.num_cached_free_blocks == 2


def test_hit_on_cached_free_blocks_takes_them_out_of_the_queue():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    c = make_request("c", list(range(8)) + [99])
    assert admit(kv, c) == [1, 2, 4]
    assert free_ids(kv) == [5, 6, 7, 8, 9, 10, 3]
    assert ref_cnts(kv, [1, 2, 4]) == [1, 1, 1]
    assert kv.num_cached_free_blocks == 0


def test_hit_is_capped_so_the_last_prompt_token_is_recomputed():
    kv = make_manager()
    admit(kv, make_request("a", list(range(12))))  # caches 3 full blocks
    # Whole prompt cached: 8 tokens = 2 full blocks, hit capped to 1 block.
    blocks, num_hit = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4 and [b.block_id for b in blocks] == [1]
    # One more token than two blocks: both blocks hit, the 9th token is computed.
    blocks, num_hit = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert num_hit == 8 and [b.block_id for b in blocks] == [1, 2]
    # A one-block prompt can never hit.
    assert kv.get_computed_blocks(make_request("d", list(range(4)))) == ([], 0)


def test_hit_requires_the_same_prefix_not_just_the_same_block():
    kv = make_manager()
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    blocks, num_hit = kv.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9]))
    assert (blocks, num_hit) == ([], 0)


def test_recomputed_duplicate_block_stays_unhashed():
    kv = make_manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)  # blocks 1, 2 both cached
    b = make_request("b", list(range(8)))
    assert admit(kv, b) == [1, 3]  # hit capped at block 1; block 2's content recomputed into 3
    assert is_cached(kv, 2) and not is_cached(kv, 3)
    assert b.block_hashes == a.block_hashes
    kv.free(a)
    kv.free(b)
    assert kv.num_cached_free_blocks == 2


def test_decode_allocates_a_block_only_when_crossing_a_boundary():
    kv = make_manager()
    r = make_request("r", [1, 2, 3, 4, 5, 6])
    assert admit(kv, r) == [1, 2]
    assert decode(kv, r, 7) == []
    assert not is_cached(kv, 2)
    assert decode(kv, r, 8) == []  # block 2 full after this step: cached now
    assert is_cached(kv, 2)
    assert decode(kv, r, 9) == [3]
    assert r.block_ids == [1, 2, 3] and len(r.block_hashes) == 2


def test_admission_respects_watermark_but_running_requests_do_not():
    kv = KVCacheManager(BS, 101, watermark_blocks=5)  # 100 usable, 5 reserved for admissions
    assert admit(kv, make_request("big", list(range(96 * BS)))) is None
    assert kv.num_free_blocks == 100 and kv.prefix_cache_queries == 0
    r = make_request("r", list(range(95 * BS + 1)))
    assert admit(kv, r, num_tokens=95 * BS) is not None
    assert kv.num_free_blocks == 5
    assert admit(kv, make_request("s", [7, 7])) is None, "one more admission would eat the reserve"
    # The running request may still grow into the reserve.
    assert kv.allocate_slots(r, 1, is_admission=False) == [96]
    assert kv.num_free_blocks == 4


def test_reviving_cached_free_blocks_counts_against_free_blocks():
    kv = make_manager()  # 10 usable blocks
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # blocks 1, 2 cached-free; 10 free
    needs_11 = make_request("b", list(range(8)) + [0] * 33)  # 2 hit blocks + 9 new (33 tokens)
    blocks, num_hit = kv.get_computed_blocks(needs_11)
    assert num_hit == 8
    assert kv.allocate_slots(needs_11, 33, blocks, num_hit, is_admission=True) is None
    assert ref_cnts(kv, [1, 2]) == [0, 0] and kv.num_free_blocks == 10, "a refusal changes nothing"
    fits = make_request("c", list(range(8)) + [0] * 32)  # 2 hit + 8 new = 10
    blocks, num_hit = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, 32, blocks, num_hit, is_admission=True) is not None
    assert kv.num_free_blocks == 0 and kv.usage == 1.0


def test_prefix_cache_stats_count_tokens_once_per_admission():
    kv = make_manager(num_blocks=5)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    b = make_request("b", list(range(8)) + [1, 2, 3, 4, 5, 6, 7])  # 2 hit blocks + 2 new; 1 free
    assert admit(kv, b) is None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0), "a refused admission is not counted"
    kv.free(a)
    assert admit(kv, b) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9 + 15, 8)


def test_caching_disabled_never_hashes():
    kv = make_manager(enable_caching=False)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert a.block_hashes == [] and kv.block_pool.cached_blocks == {}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.free(a)
    assert kv.num_cached_free_blocks == 0 and kv.num_free_blocks == 10


def test_uncache_blocks_from_drops_only_blocks_at_or_after_the_position():
    kv = make_manager()
    r = make_request("r", list(range(12)))
    admit(kv, r)  # blocks 1, 2, 3 cached
    kv.uncache_blocks_from(r, 5)  # position 5 lives in block 2
    assert [is_cached(kv, i) for i in (1, 2, 3)] == [True, False, False]


def test_pop_newly_cached_and_uncache():
    kv = make_manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)
    entries = kv.pop_newly_cached()
    assert [bid for bid, _ in entries] == [1, 2]
    assert kv.pop_newly_cached() == []
    kv.free(a)
    (reused,) = kv.block_pool.get_new_blocks(1)  # head of the queue is block 3, not cached
    assert reused.block_id == 3
    kv.uncache(entries)
    assert not is_cached(kv, 1) and not is_cached(kv, 2)
    assert kv.num_cached_free_blocks == 0


def test_uncache_leaves_a_block_that_was_recached_with_another_hash():
    kv = make_manager(num_blocks=4)  # 3 usable
    a = make_request("a", [1] * 8 + [9])
    admit(kv, a)  # blocks 1, 2 cached, 3 partial
    entries = kv.pop_newly_cached()
    kv.free(a)
    assert free_ids(kv) == [3, 2, 1]
    c = make_request("c", [5] * 8 + [9])
    assert admit(kv, c) == [3, 2, 1]  # block 2 now caches c's second block
    assert is_cached(kv, 2)
    before = dict(kv.block_pool.cached_blocks)
    kv.uncache(entries)
    assert kv.block_pool.cached_blocks == before, "uncache must only drop the exact (block, hash) pairs"


def test_reset_prefix_cache_forgets_everything():
    kv = make_manager()
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.num_cached_free_blocks == 0 and kv.pop_newly_cached() == []


def test_bad_arguments():
    kv = make_manager()
    with pytest.raises(ValueError):
        kv.allocate_slots(make_request("a", [1]), 0, is_admission=True)
