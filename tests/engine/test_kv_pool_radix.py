"""KVPool page allocation and the radix prefix cache, without a model.

Run: .venv/bin/pytest -q tests/engine/test_kv_pool_radix.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.radix_cache import RadixCache


def _pool(tokens: int = 32, page: int = 4) -> KVPool:
    return KVPool(num_layers=2, kv_dim=3, num_tokens=tokens, page_size=page, dtype=torch.float32,
                  device="cpu")


def test_pool_pages_slots_and_double_free() -> None:
    pool = _pool()
    assert pool.kv_buffer.shape == (2, 33, 3) and pool.num_pages == 8  # + the CUDA-graph padding slot
    assert pool.pad_slot == 32
    pages = pool.alloc(3)
    assert pages == [0, 1, 2] and pool.num_free_pages == 5
    assert pool.alloc(6) is None and pool.num_free_pages == 5  # all or nothing
    assert pool.slots([5, 2], 2, 7).tolist() == [22, 23, 8, 9, 10]
    assert pool.slots([5, 2, 7], 6, 7).tolist() == [10]  # the one-position (decode) path
    assert pool.slots([5, 2, 7], 5, 10).tolist() == [9, 10, 11, 28, 29]  # starts mid-page, skips page 5
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([1])
    rows = ReqToTokenPool(num_rows=2, max_context_len=8, device="cpu")
    r = rows.alloc()
    assert r is not None
    rows.write(r, 2, np.array([7, 9]))
    assert rows.req_to_token[r].tolist() == [0] * 8  # deferred: one copy for the whole step at flush()
    rows.write(r, 5, np.array([3]))
    rows.write(1 - r, 0, np.array([4, 5, 6]))
    rows.flush()
    assert rows.req_to_token[r].tolist() == [0, 0, 7, 9, 0, 3, 0, 0]
    assert rows.req_to_token[1 - r].tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    rows.flush()  # nothing pending: a no-op
    assert rows.req_to_token[r].tolist() == [0, 0, 7, 9, 0, 3, 0, 0]
    rows.write(r, 0, np.array([11, 12, 13]))  # a request's row written, then retracted (freed) ...
    rows.free(r)
    assert rows.alloc() == r  # ... and handed to another request in the same step: only its writes land
    rows.write(r, 1, np.array([21, 22]))
    rows.flush()
    assert rows.req_to_token[r].tolist() == [0, 21, 22, 9, 0, 3, 0, 0]
    for row in (0, 1):  # a decode step: one slot a row (the flush's one-slot path)
        rows.write(row, 6, np.array([40 + row]))
    rows.write(1, 7, np.array([50]))
    rows.flush()
    assert rows.req_to_token[:, 6:].tolist() == [[40, 0], [41, 50]]
    # a step scheduled ahead writes its one slot a row as one block, mixed with ordinary writes in one flush
    rows.write_ones([0, 1], [5, 5], np.array([60, 61]))
    rows.write(0, 3, np.array([70]))
    rows.flush()
    assert rows.req_to_token[:, 3:7].tolist() == [[70, 0, 60, 40], [0, 0, 61, 41]]
    rows.write_ones([0, 1], [1, 1], np.array([80, 81]))
    rows.free(1)  # a freed row's part of a block is dropped, the other row's kept
    rows.flush()
    assert rows.req_to_token[:, 1].tolist() == [80, 5]  # row 1 keeps its earlier 5, not the dropped 81


def test_radix_matches_whole_pages_and_splits() -> None:
    pool = _pool()
    cache = RadixCache(pool)
    a = list(range(10, 20))  # 10 tokens: 2 whole pages + 2 tokens in a partial page
    pages = pool.alloc(2)
    assert pages is not None
    assert cache.insert(a[:8], pages) == 0
    # a prefix that ends inside the second page matches only the first page
    got, node = cache.match_prefix(a[:6])
    assert got == pages[:1] and node.key == a[:4]
    # a longer query matches both pages, never the partial third one
    got, _ = cache.match_prefix(a + [99])
    assert got == pages
    # inserting a sequence sharing one page reports 4 tokens already cached
    b = a[:4] + [1, 2, 3, 4]
    pb = pool.alloc(2)
    assert pb is not None
    assert cache.insert(b, pb) == 4
    pool.free(pb[:1])  # the caller frees the duplicate page, as the scheduler does
    assert cache.evictable_tokens == 12


def test_radix_lock_and_lru_eviction() -> None:
    pool = _pool()
    cache = RadixCache(pool)
    seqs = [[i] * 4 for i in range(3)]
    for s in seqs:
        p = pool.alloc(1)
        assert p is not None
        cache.insert(s, p)
    _, node0 = cache.match_prefix(seqs[0])  # touch seq 0: seq 1 is now least recently used
    cache.lock(node0)
    assert cache.evict(1) == 1
    assert cache.match_prefix(seqs[1])[0] == [] and cache.match_prefix(seqs[2])[0] != []
    assert cache.flush() == 1  # seq 2 goes; seq 0 is locked
    assert cache.match_prefix(seqs[0])[0] != []
    cache.unlock(node0)
    assert cache.flush() == 1 and pool.num_free_pages == pool.num_pages


def test_radix_adopt_replaces_unlocked_nodes_the_caller_prefers() -> None:
    """adopt(): a request's own copy of cached tokens replaces the cached one node by node where `prefer`
    says so and nobody holds the node; the caller frees exactly the pages that lost (no leak, no double
    free)."""
    pool = _pool(tokens=48, page=4)
    cache = RadixCache(pool)
    toks = list(range(100, 116))  # 4 pages
    old = pool.alloc(4)
    assert old is not None and cache.insert(toks, old) == 0
    _, held = cache.match_prefix(toks[:4])  # another running request holds the first page
    cache.lock(held)
    cache.match_prefix(toks[:12])  # node boundaries at 4 and 12: nodes [0, 4), [4, 12), [12, 16)
    mine = pool.alloc(3)  # a request recomputed toks[4:] itself; its first page came from the cache
    assert mine is not None
    own = [old[0], *mine]
    assert cache.insert(toks, own) == 16  # everything was cached already
    to_free = cache.adopt(toks, own, start=4, prefer=lambda cached, new: cached[0] != old[1])
    assert cache.match_prefix(toks)[0] == [old[0], old[1], old[2], own[3]]  # [4, 12) kept, [12, 16) replaced
    assert sorted(to_free) == sorted([own[1], own[2], old[3]])
    pool.free(to_free)
    cache.unlock(held)
    cache.flush()
    assert pool.num_free_pages == pool.num_pages


def test_radix_adopt_retires_a_locked_nodes_pages_until_its_last_holder_goes() -> None:
    """A locked node takes the preferred pages too (the next request matching it gets them), but its old
    pages are still read by the requests holding it: they go back to the pool only when the last of them
    unlocks, once, even if the node was split in between."""
    pool = _pool(tokens=32, page=4)
    cache = RadixCache(pool)
    toks = list(range(8))
    old = pool.alloc(2)
    assert old is not None and cache.insert(toks, old) == 0
    _, node = cache.match_prefix(toks)
    cache.lock(node)  # two running requests use the whole prefix
    cache.lock(node)
    own = pool.alloc(2)
    assert own is not None
    free_before = pool.num_free_pages
    assert cache.adopt(toks, own, start=0, prefer=lambda cached, mine: True) == []  # nothing to free yet
    assert cache.match_prefix(toks)[0] == own  # new matches get the preferred copy
    _, upper = cache.match_prefix(toks[:4])  # a shorter match splits the node: [0, 4) above [4, 8)
    cache.lock(upper)
    cache.unlock(node)
    assert pool.num_free_pages == free_before  # one holder of the old pages is left
    cache.unlock(node)
    assert pool.num_free_pages == free_before + 2 and not set(old) & set(cache.match_prefix(toks)[0])
    cache.unlock(upper)
    cache.flush()
    assert pool.num_free_pages == pool.num_pages  # old pages freed once, own pages by the flush


def test_radix_adopt_cuts_a_node_where_the_requests_own_pages_start() -> None:
    pool = _pool(tokens=32, page=4)
    cache = RadixCache(pool)
    toks = list(range(12))
    old = pool.alloc(3)
    assert old is not None and cache.insert(toks, old) == 0  # one node [0, 12)
    mine = pool.alloc(2)
    assert mine is not None
    own = [old[0], *mine]  # the request reused page 0 from the cache and computed the rest
    to_free = cache.adopt(toks, own, start=4, prefer=lambda cached, new: True)
    assert cache.match_prefix(toks)[0] == own and sorted(to_free) == sorted(old[1:])
    pool.free(to_free)
    cache.flush()
    assert pool.num_free_pages == pool.num_pages
