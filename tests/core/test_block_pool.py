"""BlockPool and its O(1) LRU free queue: ref counts, lazy eviction, prefix-cache map."""

import pytest

from kvloop.core import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def owners_of(pool: BlockPool) -> dict[int, int]:
    """What check_invariants expects when the blocks' own ref counts are trusted."""
    return {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt}


# -- FreeBlockQueue ----------------------------------------------------------------------------
def test_free_queue_pops_in_insertion_order():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 4
    assert ids(q) == [0, 1, 2, 3]
    assert q.popleft_n(1)[0] is blocks[0]
    assert q.popleft_n(1)[0] is blocks[1]
    assert len(q) == 2
    assert ids(q) == [2, 3]


def test_free_queue_remove_from_middle_and_append_at_tail():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert blocks[2].prev is None and blocks[2].next is None
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert ids(q) == [1, 3] and len(q) == 2
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [1, 3, 2, 0] and len(q) == 4
    assert ids(q.popleft_n(1)[0] for _ in range(4)) == [1, 3, 2, 0]
    assert len(q) == 0 and list(q) == []


def test_free_queue_popleft_on_empty_raises():
    q = FreeBlockQueue([])
    with pytest.raises(RuntimeError, match="asked for 1 blocks, 0 free"):
        q.popleft_n(1)[0]
    b = KVBlock(0)
    q.append(b)
    q.popleft_n(1)[0]
    with pytest.raises(RuntimeError):
        q.popleft_n(1)[0]
    assert len(q) == 0


def test_free_queue_remove_non_member_raises():
    q = FreeBlockQueue([KVBlock(0), KVBlock(1)])
    stranger = KVBlock(7)
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(stranger)
    popped = q.popleft_n(1)[0]
    with pytest.raises(RuntimeError):
        q.remove(popped)  # already out
    assert len(q) == 1 and ids(q) == [1]


# -- BlockPool: allocation and ref counts ------------------------------------------------------
def test_pool_rejects_non_positive_size():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(0)


def test_get_new_blocks_sets_ref_count_and_leaves_queue():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert pool.usage == pytest.approx(0.75)
    pool.check_invariants({0: 1, 1: 1, 2: 1})


def test_get_new_blocks_too_many_raises_without_side_effects():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants({0: 1, 1: 1})


def test_touch_and_free_count_owners():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second request shares block a
    assert a.ref_cnt == 2
    pool.check_invariants({a.block_id: 2, b.block_id: 1})
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert pool.num_free_blocks == 3  # only b went back
    assert ids(pool.free_queue)[-1] == b.block_id
    pool.check_invariants({a.block_id: 1})
    pool.free_blocks([a])
    assert pool.num_free_blocks == 4
    pool.check_invariants({})


def test_lru_freed_first_is_reused_first():
    pool = BlockPool(4)
    b0, b1, _b2, b3 = pool.get_new_blocks(4)
    pool.free_blocks([b1])
    pool.free_blocks([b3])
    assert ids(pool.get_new_blocks(1)) == [1]
    pool.free_blocks([b0])
    assert ids(pool.get_new_blocks(2)) == [3, 0]
    pool.check_invariants({0: 1, 1: 1, 2: 1, 3: 1})


def test_free_blocks_respects_the_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert ids(pool.free_queue) == [2, 0, 3, 1]
    assert ids(pool.get_new_blocks(4)) == [2, 0, 3, 1]


def test_initial_allocation_order_after_partial_frees():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)  # 0, 1
    pool.free_blocks(reversed(a))  # tail first: 1 then 0 at the back
    assert ids(pool.free_queue) == [2, 3, 4, 1, 0]


# -- BlockPool: prefix cache -------------------------------------------------------------------
def test_cached_free_block_keeps_hash_until_reused():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, 111)
    pool.free_blocks([b0])
    # Free but still cached: a prefix hit could revive it.
    assert b0.ref_cnt == 0 and b0.block_hash == 111
    assert pool.cached.get(111) is b0
    pool.check_invariants({})
    # LRU: block 1 was free longer, so it goes first; b0 keeps its hash.
    (b1,) = pool.get_new_blocks(1)
    assert b1.block_id == 1
    assert pool.cached.get(111) is b0 and pool.num_evictions == 0
    pool.check_invariants({1: 1})
    # Now b0 is handed out again: lazily evicted.
    (again,) = pool.get_new_blocks(1)
    assert again is b0
    assert b0.block_hash is None and pool.cached.get(111) is None
    assert pool.cached == {} and pool.num_evictions == 1
    pool.check_invariants({0: 1, 1: 1})


def test_touch_revives_cached_free_block():
    pool = BlockPool(3)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, 42)
    pool.free_blocks([b0])
    assert pool.num_free_blocks == 3
    pool.touch([pool.cached.get(42)])
    assert b0.ref_cnt == 1 and b0.block_hash == 42
    assert pool.num_free_blocks == 2
    assert 0 not in ids(pool.free_queue)
    pool.check_invariants({0: 1})
    # The revived block is not handed out to anyone else.
    assert 0 not in ids(pool.get_new_blocks(2))
    assert pool.num_evictions == 0


def test_cache_block_first_writer_wins():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 7)
    pool.cache_block(b1, 7)  # same prefix computed twice: the first block stays
    assert pool.cached.get(7) is b0 and b1.block_hash is None
    pool.cache_block(b0, 8)  # a block registers under one hash only
    assert b0.block_hash == 7 and pool.cached.get(8) is None
    pool.cache_block(b1, 8)
    assert pool.cached.get(8) is b1
    assert pool.cached == {7: b0, 8: b1}
    pool.check_invariants({0: 1, 1: 1})


def test_check_invariants_passes_on_a_busy_pool():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    pool.cache_block(a[0], 10)
    pool.cache_block(a[1], 11)
    pool.touch(a[:1])
    pool.free_blocks(reversed(a))
    pool.check_invariants(owners_of(pool))
    assert owners_of(pool) == {0: 1}


def test_check_invariants_catches_bumped_ref_count():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt += 1
    with pytest.raises(AssertionError, match="owners"):
        pool.check_invariants({b.block_id: 1})


def test_check_invariants_catches_owned_block_left_in_queue():
    pool = BlockPool(4)
    pool.blocks[3].ref_cnt = 1  # owned, but never taken out of the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants({3: 1})


def test_check_invariants_catches_free_block_out_of_queue():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # dropped its owner without joining the queue
    with pytest.raises(AssertionError, match="free xor owned"):
        pool.check_invariants({})


def test_check_invariants_catches_stale_hash_on_block():
    pool = BlockPool(4)
    pool.blocks[2].block_hash = 99  # a hash the map does not know
    with pytest.raises(AssertionError, match="keeps a hash"):
        pool.check_invariants({})


def test_check_invariants_catches_map_pointing_at_reused_block():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, 5)
    b.block_hash = None  # reused without dropping the map entry
    with pytest.raises(AssertionError, match="hash 5"):
        pool.check_invariants({b.block_id: 1})


def test_check_invariants_catches_drifted_free_count():
    pool = BlockPool(4)
    pool.free_queue.num_free += 1
    with pytest.raises(AssertionError, match="drifted"):
        pool.check_invariants({})
