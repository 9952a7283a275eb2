"""Block accounting: atomic claims, plane groups, prefix-cache references and eviction order."""

from __future__ import annotations

from kvgate.scheduler.kv import BlockPool, page_hashes


def test_pages_take_one_block_per_plane_and_claims_are_atomic() -> None:
    pool = BlockPool(num_blocks=12, block_size=2, num_planes=3, enable_prefix_caching=True)
    assert pool.allocate("a", 2, []) is not None
    assert pool.num_free_blocks == 6
    assert pool.allocate("b", 3, []) is None  # needs 9 of 6: nothing changes
    assert pool.num_free_blocks == 6 and not pool.has_table("b")
    assert pool.grow("a", 5) is None
    assert pool.num_pages("a") == 2
    assert pool.grow("a", 4) is not None and pool.num_free_blocks == 0
    assert pool.check() == []
    assert len(pool.release("a")) == 4 and pool.num_free_blocks == 12


def test_claims_take_the_top_of_the_free_stack_in_pop_order() -> None:
    # Block ids reach the executor, so the order a claim takes them in is part of the plan:
    # lowest ids first on a fresh pool, the most recently freed first afterwards, one block per
    # plane in each page.
    pool = BlockPool(num_blocks=12, block_size=2, num_planes=3, enable_prefix_caching=False)
    assert pool.allocate("a", 2, []) == [(0, 1, 2), (3, 4, 5)]
    assert pool.grow("a", 3) == [(6, 7, 8)]
    pool.release("a")
    assert pool.allocate("b", 2, []) == [(8, 7, 6), (5, 4, 3)]
    assert pool.grow("b", 4) == [(2, 1, 0), (9, 10, 11)]
    assert pool.num_free_blocks == 0 and pool.check() == []


def test_prefix_pages_are_shared_by_reference_and_evicted_lru_only_when_needed() -> None:
    pool = BlockPool(num_blocks=8, block_size=2, num_planes=2, enable_prefix_caching=True)
    prompt = [5, 6, 7, 8, 9]
    digests = page_hashes(prompt, 2)
    assert len(digests) == 2  # pages of prompt[:-1] = [5,6],[7,8]
    pool.allocate("a", 3, [])
    pool.publish("a", digests, 2)
    pool.release("a")
    assert pool.num_free_blocks == 8  # cached pages held by nobody else count as free
    prefix = pool.lookup_prefix(digests)
    assert len(prefix) == 2
    # A claim that does not fit must not destroy the cached prefix.
    assert pool.allocate("big", 5, []) is None
    assert pool.lookup_prefix(digests) == prefix
    # Taking the prefix costs its blocks (they stop being evictable) plus the fresh page.
    assert pool.claim_cost(1, prefix) == 6
    fresh = pool.allocate("b", 3, prefix)
    assert fresh is not None and len(fresh) == 1
    assert pool.table("b")[:2] == prefix
    assert pool.reclaimable_blocks("b") == 6  # the prefix would become evictable again
    # Another request evicts the least recently used cached page only when it must.
    pool.release("b")
    assert pool.allocate("c", 3, []) is not None
    assert pool.lookup_prefix(digests) == []  # the first page was the least recently used
    assert pool.lookup_prefix(digests[1:]) == prefix[1:]
    assert pool.check() == []


def test_reclaimable_ignores_pages_another_request_still_holds() -> None:
    pool = BlockPool(num_blocks=8, block_size=2, num_planes=1, enable_prefix_caching=True)
    digests = page_hashes([1, 2, 3, 4, 5], 2)
    pool.allocate("a", 3, [])
    pool.publish("a", digests, 2)
    pool.allocate("b", 3, pool.lookup_prefix(digests))
    assert pool.reclaimable_blocks("b") == 1  # only its own third page
    pool.release("a")
    assert pool.reclaimable_blocks("b") == 3


def test_check_reports_corrupted_reference_counts() -> None:
    pool = BlockPool(num_blocks=4, block_size=1, num_planes=1, enable_prefix_caching=False)
    pool.allocate("a", 2, [])
    pool._refs[0] += 1
    assert pool.check()
