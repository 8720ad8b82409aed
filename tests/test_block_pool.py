"""BlockPool and FreeBlockQueue: exact block ids, ref counts and free-queue order."""

from __future__ import annotations

import hashlib
import struct

import pytest

from scheduler_svc.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_init_reserves_null_block():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_total_blocks == 5
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0
    assert pool.null_block.block_id == 0 and pool.null_block.prev_free is None


@pytest.mark.parametrize("kwargs", [{"num_blocks": 1}, {"num_blocks": 4, "hash_algo": "md5"}])
def test_init_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        BlockPool(enable_caching=True, **kwargs)


def test_get_new_blocks_pops_lru_first_and_sets_ref_cnt():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_used_blocks == 2
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [3, 4, 5], "a refused request must not take blocks"


def test_free_blocks_appends_in_given_order():
    pool = BlockPool(6, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.free_blocks([b3, b1])  # tail first, as the manager passes them
    assert free_ids(pool) == [4, 5, 3, 1]
    assert (b1.ref_cnt, b2.ref_cnt, b3.ref_cnt) == (0, 1, 0)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [4, 5, 3]


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.touch([b1])
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    assert b1.ref_cnt == 1 and free_ids(pool) == [2, 3]
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0 and free_ids(pool) == [2, 3, 1]


def test_touch_removes_free_block_from_middle_of_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    pool.touch([blocks[2]])
    assert free_ids(pool) == [1, 2, 4, 5]
    assert blocks[2].ref_cnt == 1 and pool.num_free_blocks == 4
    pool.touch([blocks[0], blocks[4]])  # head and tail
    assert free_ids(pool) == [2, 4]


def test_cache_full_blocks_and_lookup():
    pool = BlockPool(6, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    h1 = pool.hash_block(None, [1, 2])
    h2 = pool.hash_block(h1, [3, 4])
    assert pool.cache_full_block(b1, h1) and pool.cache_full_block(b2, h2)
    assert pool.get_cached_block(h1) is b1 and pool.get_cached_block(h2) is b2
    assert b1.block_hash == h1
    assert pool.num_cached_free_blocks == 0
    pool.free_blocks([b2, b1])
    assert pool.num_cached_free_blocks == 2
    assert pool.get_cached_block(h1) is b1, "a free block keeps its cached prefix"


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(6, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    h = pool.hash_block(None, [7, 7])
    assert pool.cache_full_block(b1, h) is True
    assert pool.cache_full_block(b2, h) is False
    assert pool.get_cached_block(h) is b1 and b2.block_hash is None


def test_reallocating_cached_free_block_evicts_its_hash():
    pool = BlockPool(3, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    h = pool.hash_block(None, [1])
    pool.cache_full_block(b1, h)
    pool.free_blocks([b1, b2])
    assert free_ids(pool) == [1, 2] and pool.num_cached_free_blocks == 1
    (again,) = pool.get_new_blocks(1)
    assert again is b1
    assert again.block_hash is None and pool.get_cached_block(h) is None
    assert pool.num_cached_free_blocks == 0


def test_touching_cached_free_block_updates_cached_free_count():
    pool = BlockPool(4, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.cache_full_block(b1, pool.hash_block(None, [5]))
    pool.free_blocks([b1])
    assert pool.num_cached_free_blocks == 1
    pool.touch([b1])
    assert pool.num_cached_free_blocks == 0 and b1.ref_cnt == 1


def test_uncache_block_and_reset_prefix_cache():
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3 = pool.get_new_blocks(3)
    hashes = [pool.hash_block(None, [i]) for i in range(3)]
    for block, block_hash in zip((b1, b2, b3), hashes):
        pool.cache_full_block(block, block_hash)
    pool.free_blocks([b1])
    pool.uncache_block(b1)
    assert b1.block_hash is None and pool.get_cached_block(hashes[0]) is None
    assert pool.num_cached_free_blocks == 0
    pool.uncache_block(b1)  # no-op on an unhashed block
    pool.free_blocks([b2])
    pool.reset_prefix_cache()
    assert pool.cached_blocks == {} and b2.block_hash is None and b3.block_hash is None
    assert pool.num_cached_free_blocks == 0
    assert b3.ref_cnt == 1, "resetting the cache does not free held blocks"


def test_hash_is_canonical_sha256_of_documented_encoding():
    parent = hashlib.sha256(b"p").digest()
    tokens = [1, 70000, 3]
    expected = hashlib.sha256(b"\x01" + parent + struct.pack("<I", 3) + b"abc" + struct.pack("<3q", *tokens)).digest()
    assert hash_block_tokens(hashlib.sha256, parent, tokens, b"abc") == expected
    root = hashlib.sha256(b"\x00" + struct.pack("<I", 0) + struct.pack("<3q", *tokens)).digest()
    assert hash_block_tokens(hashlib.sha256, None, tokens) == root


def test_hash_depends_on_every_input():
    pool = BlockPool(2, enable_caching=True)
    base = pool.hash_block(None, [1, 2, 3])
    assert pool.hash_block(None, [1, 2, 3]) == base
    assert pool.hash_block(None, [1, 3, 2]) != base
    assert pool.hash_block(base, [1, 2, 3]) != base
    assert pool.hash_block(None, [1, 2, 3], b"salt") != base
    blake = BlockPool(2, enable_caching=True, hash_algo="blake2b").hash_block(None, [1, 2, 3])
    assert blake != base and len(blake) == 32


def test_free_block_queue_operations():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3] and len(queue) == 4
    queue.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[1])
    assert [b.block_id for b in queue] == [2, 3, 1] and len(queue) == 3
    for _ in range(3):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert len(queue) == 0
