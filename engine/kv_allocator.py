"""KVAllocator: a request's KV pages, from admission to release (the scheduler decides who runs; this decides where
their KV goes).

A request holds `req.pages` (pages of the KVPool) covering its first kv_len positions, a row of req_to_token
(`req.pool_row`) mapping position -> slot, and, after a prefix-cache hit, a lock on the cache node it reused.
- admit: a req_to_token row, the prefix match (cut where route capture says the cached KV may not be reused), then
  the first chunk's slots; all undone when the chunk gets no page;
- grow: slots for more positions, evicting the prefix cache before shrinking the request's share;
- grow_all: slots for many requests' next positions at once, all or nothing (a decode or verify step);
- trim: drop positions past kv_len (a verify's rejected drafts);
- release: whole computed pages to the prefix cache (or the better of two copies of the same tokens), the rest to
  the pool, then the row.
Every RequestHooks call made here (usable_prefix, on_admit, prefer_pages) runs while the KV it names is valid.
"""

from __future__ import annotations

import numpy as np

from r3trace.engine.kv_pool import KVPool, ReqToTokenPool
from r3trace.engine.radix_cache import RadixCache
from r3trace.engine.request import Req
from r3trace.engine.request_hooks import RequestHooks


class KVAllocator:
    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool, cache: RadixCache | None, hooks: RequestHooks) -> None:
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache
        self.hooks = hooks

    def admit(self, req: Req, budget: int) -> np.ndarray | None:
        """A waiting request's row, prefix match and first chunk of at most `budget` positions: its slots [n], or
        None (nothing held) when no row or no page is free."""
        row = self.req_pool.alloc()
        if row is None:
            return None
        req.pool_row = row
        fill = req.fill_ids
        if self.cache is not None and req.use_prefix_cache:
            limit = len(fill) - 1  # the last token is always computed: its logits give the next token
            if req.wants_input_logprobs:
                assert req.logprob is not None
                limit = min(limit, max(req.logprob.start_len - 1, 0))
            pages, node = self.cache.match_prefix(fill[:limit])
            if pages:  # route capture may need the prefix cut where its routes are not on the host
                page = self.pool.page_size
                usable = self.hooks.usable_prefix(req, self.pool.slots(list(pages), 0, len(pages) * page))
                pages = pages[: usable // page]
            self.cache.lock(node)  # the whole match stays locked; only its usable pages are reused
            req.cache_node, req.pages = node, list(pages)
            req.kv_len = req.cached_len = len(pages) * self.pool.page_size
            if req.kv_len:
                self.req_pool.write(row, 0, self.pool.slots(req.pages, 0, req.kv_len))
        slots = self.grow(req, min(len(fill) - req.kv_len, budget))
        if slots is None:
            self.release(req, cache_it=False)
            return None
        req.cached_tokens += req.cached_len
        self.hooks.on_admit(req)
        return slots

    def grow(self, req: Req, want: int) -> np.ndarray | None:
        """Give req KV slots for `want` more positions, or as many as whole free pages allow (a
        chunk shrinks; a decode needs its one slot). Returns the slots [n] or None when n == 0."""
        page = self.pool.page_size
        need = self.pool.pages_for(req.kv_len + want) - len(req.pages)
        if need > self.pool.num_free_pages and self.cache is not None:
            self.cache.evict(need - self.pool.num_free_pages)
        if need > self.pool.num_free_pages:
            need = self.pool.num_free_pages
            want = (len(req.pages) + need) * page - req.kv_len
        if want <= 0:
            return None
        pages = self.pool.alloc(need)
        assert pages is not None
        req.pages.extend(pages)
        slots = self.pool.slots(req.pages, req.kv_len, req.kv_len + want)
        self.req_pool.write(req.pool_row, req.kv_len, slots)
        return slots

    def grow_all(self, reqs: list[Req], wants: list[int]) -> np.ndarray | None:
        """Slots [sum(wants)] for wants[i] more positions of each reqs[i], in request order, from one page allocation
        and one req_to_token block write; None, with nothing taken, when the free pages do not hold them all or a
        request holds pages past its positions (grow's per-request path then evicts, shrinks or retracts). A step's
        decoding requests at once: grow per request was ~8-10 us each on the H200 host, 0.3 ms a step at batch 32
        under speculation and 1 ms at 128 decoding requests, against a GPU step of ~0.6 ms."""
        page = self.pool.page_size
        needs = [self.pool.pages_for(r.kv_len + w) - len(r.pages) for r, w in zip(reqs, wants, strict=True)]
        new_pages = self.pool.alloc(sum(needs)) if min(needs, default=0) >= 0 else None
        if new_pages is None:
            return None
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        at = 0
        for req, want, need in zip(reqs, wants, needs, strict=True):
            req.pages += new_pages[at : at + need]
            at += need
            pages, start = req.pages, req.kv_len
            slots += [pages[pos // page] * page + pos % page for pos in range(start, start + want)]
            rows += [req.pool_row] * want
            positions += range(start, start + want)
        out = np.asarray(slots, dtype=np.int64)
        self.req_pool.write_ones(rows, positions, out)
        return out

    def trim(self, reqs: list[Req]) -> None:
        """Pages past each request's kv_len (positions computed and then dropped) go back to the pool, in one free
        (the order of the per-request frees, so allocation stays reproducible)."""
        dropped: list[int] = []
        for req in reqs:
            keep_pages = self.pool.pages_for(req.kv_len)
            if keep_pages < len(req.pages):
                dropped += req.pages[keep_pages:]
                del req.pages[keep_pages:]
        if dropped:
            self.pool.free(dropped)

    def release(self, req: Req, cache_it: bool) -> None:
        """Return req's pages: whole computed pages go to the prefix cache when cache_it, the rest
        to the pool. Pages it got from the cache stay there (unlocked)."""
        page = self.pool.page_size
        own_from = req.cached_len // page  # pages before this came from the cache
        if self.cache is not None and req.cache_node is not None:
            self.cache.unlock(req.cache_node)  # first: adopt() frees at once the pages of nodes nobody holds
        if self.cache is not None and cache_it and req.use_prefix_cache:
            full = req.kv_len // page
            present = self.cache.insert(req.fill_ids[: full * page], req.pages[:full]) // page
            if present > own_from:  # the cache already held these tokens: keep the better copy, free the other
                self.pool.free(self.cache.adopt(req.fill_ids[: present * page], req.pages[:present],
                                                own_from * page, self._prefer_pages))
            self.pool.free(req.pages[full:])  # the partly filled last page is never shared
        else:
            self.pool.free(req.pages[own_from:])
        self.req_pool.free(req.pool_row)
        req.reset_kv()

    def _prefer_pages(self, cached: list[int], own: list[int]) -> bool:
        page = self.pool.page_size
        return self.hooks.prefer_pages(self.pool.slots(cached, 0, len(cached) * page),
                                       self.pool.slots(own, 0, len(own) * page))

    def slots(self, req: Req) -> np.ndarray:
        """[kv_len] int64 host: the KV slot of each computed position of a running request."""
        return self.pool.slots(req.pages, 0, req.kv_len)

    def pool_full_message(self, req: Req) -> str:
        return (
            f"KV pool exhausted: the request needs {req.kv_len + 1} slots, kv_pool_tokens="
            f"{self.pool.num_tokens} (page_size={self.pool.page_size})"
        )
