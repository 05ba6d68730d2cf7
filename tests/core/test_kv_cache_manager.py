"""KVCacheManager: slot arithmetic, prefix hits, release order and the host swap tier."""

import pytest

from kvloop.config import CacheConfig
from kvloop.core import KVCacheManager, Request

BS = 4


def make_kv(num_gpu_blocks: int = 16, num_cpu_blocks: int = 0, caching: bool = True):
    return KVCacheManager(
        CacheConfig(
            block_size=BS,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=caching,
        )
    )


def make_req(rid: str, tokens, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), cache_salt=salt)


def compute(kv: KVCacheManager, r: Request, n: int) -> list[int] | None:
    """Allocate slots for ``n`` tokens, mark them computed and offer full blocks to the cache."""
    new = kv.allocate_slots(r, n)
    assert new is not None
    r.num_computed_tokens += n
    kv.commit_computed([r])
    kv.check_invariants()
    return new


def admit(kv: KVCacheManager, r: Request, n: int | None = None) -> list[int] | None:
    """What the scheduler does on admission: look up hits, count them computed, allocate."""
    hits = kv.get_computed_blocks(r)
    r.num_computed_tokens = len(hits) * BS
    if n is None:
        n = r.num_tokens - r.num_computed_tokens
    new = kv.allocate_slots(r, n, hits)
    if new is None:
        r.num_computed_tokens = 0
    kv.check_invariants()
    return new


def hit_ids(kv: KVCacheManager, r: Request) -> list[int]:
    return [b.block_id for b in kv.get_computed_blocks(r)]


# -- allocation arithmetic ---------------------------------------------------------------------
def test_allocate_slots_across_block_boundaries():
    kv = make_kv()
    r = make_req("r", range(100, 120))
    assert kv.allocate_slots(r, 5) == [0, 1]  # tokens 0..4 need 2 blocks
    kv.check_invariants()
    r.num_computed_tokens = 5
    assert kv.allocate_slots(r, 3) == []  # tokens 5..7 still fit block 1
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 1) == [2]  # token 8 opens block 2
    kv.check_invariants()
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 7) == [3]  # up to token 15: block 3 exactly
    assert kv.allocate_slots(r, 7) == []  # asking again needs nothing new
    assert kv.allocate_slots(r, 12) == [4, 5]  # up to token 20: 6 blocks
    assert kv.block_ids("r") == [0, 1, 2, 3, 4, 5]
    assert kv.num_used_blocks == 6 and kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocate_zero_tokens_for_new_request_makes_no_table():
    kv = make_kv()
    r = make_req("r", range(3))
    assert kv.allocate_slots(r, 0) == []
    assert "r" not in kv.req_blocks and kv.block_ids("r") == []
    kv.check_invariants()


def test_blocks_needed_rounds_up():
    kv = make_kv()
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_slots_none_when_full_without_side_effects():
    kv = make_kv(num_gpu_blocks=4)
    a = make_req("a", range(20))
    b = make_req("b", range(50, 60))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    a.num_computed_tokens = 12
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert "b" not in kv.req_blocks
    assert kv.allocate_slots(a, 5) is None  # 17 tokens: 2 more blocks, 1 free
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 1
    kv.check_invariants()
    assert kv.allocate_slots(a, 4) == [3]  # exactly fills the pool
    assert kv.num_free_blocks == 0 and kv.usage == 1.0
    assert kv.allocate_slots(b, 1) is None
    kv.check_invariants()


# -- prefix cache ------------------------------------------------------------------------------
def test_only_full_computed_blocks_are_cached():
    kv = make_kv()
    a = make_req("a", range(10))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    kv.commit_computed([a])  # nothing computed yet
    assert kv.pool.cached == {}
    a.num_computed_tokens = 6
    kv.commit_computed([a])  # one full computed block
    assert [b.block_id for b in kv.pool.cached.values()] == [0]
    kv.check_invariants()
    b = make_req("b", range(10))
    assert hit_ids(kv, b) == [0]
    a.num_computed_tokens = 10
    kv.commit_computed([a])  # block 2 (tokens 8, 9) is partial: never cached
    assert sorted(b.block_id for b in kv.pool.cached.values()) == [0, 1]
    assert hit_ids(kv, b) == [0, 1]
    kv.check_invariants()


def test_last_token_is_never_served_from_cache():
    kv = make_kv()
    a = make_req("a", range(8))
    compute(kv, a, 8)
    assert len(kv.pool.cached) == 2
    assert hit_ids(kv, make_req("same", range(8))) == [0]  # token 7 must be computed
    assert hit_ids(kv, make_req("one_more", range(9))) == [0, 1]
    assert hit_ids(kv, make_req("one_block", range(4))) == []
    assert hit_ids(kv, make_req("five", range(5))) == [0]


def test_same_block_after_a_different_prefix_is_not_a_hit():
    kv = make_kv()
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make_req("a", x + y + [0])
    compute(kv, a, 9)
    b = make_req("b", z + y + [0])
    assert hit_ids(kv, b) == []
    # Chained: block 1 of b holds the same tokens as block 1 of a, yet hashes differently.
    assert b.block_hashes[1] != a.block_hashes[1]
    assert kv.pool.cached.get(b.block_hashes[1]) is None
    c = make_req("c", x + z + [0])
    assert hit_ids(kv, c) == [0]  # shares x only
    d = make_req("d", x + y + [0, 1, 2])
    assert hit_ids(kv, d) == [0, 1]


def test_cache_salt_isolates_prefixes():
    kv = make_kv()
    a = make_req("a", range(9), salt="tenant-1")
    compute(kv, a, 9)
    assert hit_ids(kv, make_req("b", range(9), salt="tenant-2")) == []
    assert hit_ids(kv, make_req("c", range(9))) == []
    assert hit_ids(kv, make_req("d", range(9), salt="tenant-1")) == [0, 1]
    e = make_req("e", range(9))
    compute(kv, e, 9)
    assert hit_ids(kv, make_req("f", range(9))) == kv.block_ids("e")[:2]
    assert set(kv.block_ids("e")).isdisjoint(kv.block_ids("a"))


def test_prefix_caching_disabled():
    kv = make_kv(caching=False)
    a = make_req("a", range(9))
    compute(kv, a, 9)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_req("b", range(9))) == []


def test_shared_hits_are_ref_counted():
    kv = make_kv(num_gpu_blocks=8)
    a = make_req("a", range(12))
    compute(kv, a, 12)
    b = make_req("b", [*range(12), 99, 98])
    assert admit(kv, b) == [0, 1, 2, 3]  # hits first, then one fresh block
    assert b.num_computed_tokens == 12
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [2, 2, 2, 1]
    kv.free(a)
    kv.check_invariants()
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [1, 1, 1, 1]
    assert kv.num_used_blocks == 4
    kv.free(b)
    kv.check_invariants()
    assert kv.num_used_blocks == 0


def test_hits_reviving_cached_free_blocks_count_against_free_capacity():
    kv = make_kv(num_gpu_blocks=4)
    a = make_req("a", range(9))
    compute(kv, a, 9)  # blocks 0, 1 cached; block 2 partial
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.pool.cached) == 2
    other = make_req("other", range(500, 504))
    assert compute(kv, other, 4) == [3]
    assert kv.num_free_blocks == 3
    # b hits blocks 0 and 1 (both cached free) and needs 2 fresh ones: 2 + 2 > 3 free.
    b = make_req("b", list(range(9)) + [50] * 7)
    hits = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and all(h.ref_cnt == 0 for h in hits)
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 8, hits) is None
    # No side effects: the hits are still cached free blocks, b has no table.
    assert all(h.ref_cnt == 0 for h in hits)
    assert kv.num_free_blocks == 3 and "b" not in kv.req_blocks
    kv.check_invariants()
    # One fresh block plus two revived ones fit exactly.
    assert kv.allocate_slots(b, 4, hits) == [0, 1, 2]
    assert kv.num_free_blocks == 0
    assert [h.ref_cnt for h in hits] == [1, 1]
    assert kv.pool.num_evictions == 0
    kv.check_invariants()


def test_free_releases_tail_first_so_shared_prefix_stays_cached():
    kv = make_kv(num_gpu_blocks=6)
    a = make_req("a", range(13))
    compute(kv, a, 13)  # blocks 0..3; 0, 1, 2 cached
    kv.free(a)
    assert "a" not in kv.req_blocks
    assert [b.block_id for b in kv.pool.free_queue] == [4, 5, 3, 2, 1, 0]
    kv.check_invariants()
    d = make_req("d", range(700, 716))
    assert kv.allocate_slots(d, 16) == [4, 5, 3, 2]  # evicts the tail block 2 first
    assert kv.pool.num_evictions == 1
    kv.check_invariants()
    # The leading prefix blocks survived.
    assert hit_ids(kv, make_req("e", range(13))) == [0, 1]


def test_free_unknown_request_is_a_no_op():
    kv = make_kv()
    kv.free(make_req("ghost", range(3)))
    kv.check_invariants()
    assert kv.num_free_blocks == 16


# -- swap tier ---------------------------------------------------------------------------------
def test_swap_out_and_in_round_trip():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=4)
    a = make_req("a", range(10))
    compute(kv, a, 10)
    assert kv.can_swap_out(a)
    out = kv.swap_out(a)
    assert [d for d, _ in out] == [0, 1, 2]
    host = [h for _, h in out]
    assert len(set(host)) == 3 and all(0 <= h < 4 for h in host)
    assert kv.num_free_cpu_blocks == 1 and kv.swapped_blocks["a"] == host
    assert "a" not in kv.req_blocks and kv.num_free_blocks == 8
    assert len(kv.pool.cached) == 2  # hashes stay until evicted
    kv.check_invariants()

    assert kv.can_swap_in(a, 1)
    filler = make_req("filler", range(300, 324))
    compute(kv, filler, 24)  # 6 blocks: 2 left, a needs 3
    assert not kv.can_swap_in(a, 1)
    kv.free(filler)
    kv.check_invariants()
    assert kv.can_swap_in(a, 1)

    back = kv.swap_in(a)
    assert [h for h, _ in back] == host  # same order as swapped out
    assert [d for _, d in back] == kv.block_ids("a")
    assert len(back) == 3 and kv.num_free_cpu_blocks == 4
    assert "a" not in kv.swapped_blocks
    kv.check_invariants()
    assert kv.allocate_slots(a, 1) == []  # token 10 fits the third block
    a.num_computed_tokens = 11
    assert len(kv.allocate_slots(a, 2)) == 1  # token 12 opens a fourth
    kv.check_invariants()
    kv.commit_computed([a])
    kv.check_invariants()


def test_can_swap_in_counts_new_tokens():
    kv = make_kv(num_gpu_blocks=4, num_cpu_blocks=4)
    a = make_req("a", range(8))
    compute(kv, a, 8)
    kv.swap_out(a)
    other = make_req("other", range(200, 204))
    compute(kv, other, 4)  # 3 device blocks left
    assert kv.can_swap_in(a, 4)  # 12 tokens: 3 blocks
    assert not kv.can_swap_in(a, 5)  # 13 tokens: 4 blocks


def test_can_swap_out_false_when_host_tier_too_small():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=2)
    a = make_req("a", range(10))
    compute(kv, a, 10)
    assert not kv.can_swap_out(a)
    small = make_req("small", range(100, 108))
    compute(kv, small, 8)
    assert kv.can_swap_out(small)
    kv.swap_out(small)
    assert kv.num_free_cpu_blocks == 0
    kv.check_invariants()
    assert not kv.can_swap_out(a)


def test_no_host_tier_means_no_swap():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=0)
    a = make_req("a", range(5))
    compute(kv, a, 5)
    assert not kv.can_swap_out(a)


def test_free_of_swapped_request_releases_host_blocks():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=4)
    a = make_req("a", range(10))
    compute(kv, a, 10)
    kv.swap_out(a)
    kv.free(a)
    assert kv.swapped_blocks == {} and kv.num_free_cpu_blocks == 4
    kv.check_invariants()


def test_swap_out_of_request_sharing_prefix_blocks():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=8)
    a = make_req("a", range(9))
    compute(kv, a, 9)
    b = make_req("b", [*range(9), 42])
    admit(kv, b)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    pairs = kv.swap_out(b)
    assert [d for d, _ in pairs] == [*kv.block_ids("a")[:2], pairs[2][0]]
    assert [blk.ref_cnt for blk in kv.req_blocks["a"]] == [1, 1, 1]
    kv.check_invariants()
    kv.swap_in(b)
    assert set(kv.block_ids("b")).isdisjoint(kv.block_ids("a"))
    kv.check_invariants()


def test_swap_out_failure_has_no_side_effects():
    kv = make_kv(num_gpu_blocks=8, num_cpu_blocks=2)
    a = make_req("a", range(10))
    compute(kv, a, 10)
    with pytest.raises(RuntimeError):
        kv.swap_out(a)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_invariants()


def test_swap_in_failure_has_no_side_effects():
    kv = make_kv(num_gpu_blocks=4, num_cpu_blocks=4)
    a = make_req("a", range(10))
    compute(kv, a, 10)
    host = [h for _, h in kv.swap_out(a)]
    filler = make_req("filler", range(100, 112))
    compute(kv, filler, 12)  # 1 block left, a needs 3
    assert not kv.can_swap_in(a, 0)
    with pytest.raises(RuntimeError):
        kv.swap_in(a)
    assert kv.swapped_blocks.get("a") == host
    kv.check_invariants()
