"""Prefix cache: a radix tree over token ids whose nodes own KV pages.

Matching and inserting work at page granularity (P = page_size): every node's key is a whole number
of pages, so a shared prefix is always a list of whole pages. A request's partly filled last page is
never shared; those tokens are recomputed by the next request (at most P - 1 per request).

A node in use is locked (lock_ref > 0 on it and every ancestor) and never evicted. Unlocked leaves
are evicted least recently used first; their pages go back to the KVPool. adopt() may give a locked node
new pages: the old ones are retired on the node (its holders still read them) and go back to the pool
when its last lock is released.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from r3trace.engine.kv_pool import KVPool


class TreeNode:
    _ids = itertools.count()

    def __init__(self, key: list[int], pages: list[int], parent: TreeNode | None) -> None:
        self.key = key  # token ids, len = P * len(pages)
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # by the first page of the child's key
        self.lock_ref = 0
        self.retired: list[int] = []  # pages adopt() replaced while the node was locked: freed at lock_ref 0
        self.last_access = 0
        self.id = next(TreeNode._ids)  # tie-breaker in the eviction heap

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.root = TreeNode([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = 0  # logical LRU clock: reproducible, unlike wall time
        self.evictable_tokens = 0
        self.locked_tokens = 0

    def _first_page(self, tokens: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _common_len(self, key: list[int], tokens: list[int], start: int) -> int:
        """Whole pages shared by key and tokens[start:], in tokens."""
        n, p = 0, self.page_size
        limit = min(len(key), len(tokens) - start)
        while n + p <= limit and key[n : n + p] == tokens[start + n : start + n + p]:
            n += p
        return n

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut node's key at token `at` (a page boundary); return the new upper half. Retired pages stay on
        the lower half: every request holding them locked the whole node, so its lock passes through both."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % self.page_size == 0
        upper = TreeNode(node.key[:at], node.pages[: at // self.page_size], parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        parent.children[self._first_page(upper.key)] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // self.page_size :], upper
        upper.children[self._first_page(node.key)] = node
        return upper

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """The longest cached whole-page prefix of tokens: (its pages, the node where it ends)."""
        self._clock += 1
        node, pages, i = self.root, [], 0
        while i + self.page_size <= len(tokens):
            child = node.children.get(self._first_page(tokens, i))
            if child is None:
                break
            n = self._common_len(child.key, tokens, i)
            child.last_access = self._clock
            if n < len(child.key):
                child = self._split(child, n)
            pages.extend(child.pages)
            i += n
            node = child
        return pages, node

    def insert(self, tokens: list[int], pages: list[int]) -> int:
        """Cache tokens (whole pages) -> pages; return how many leading tokens were already cached.

        The caller owns pages[:returned // P] still and must free those it did not get from the cache.
        """
        if len(tokens) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(tokens)} tokens for {len(pages)} pages of {self.page_size}")
        self._clock += 1
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(self._first_page(tokens, i))
            if child is None:
                leaf = TreeNode(tokens[i:], pages[i // self.page_size :], node)
                leaf.last_access = self._clock
                node.children[self._first_page(leaf.key)] = leaf
                self.evictable_tokens += len(leaf.key)
                return i
            n = self._common_len(child.key, tokens, i)
            child.last_access = self._clock
            if n < len(child.key):
                child = self._split(child, n)
            i += n
            node = child
        return i

    def adopt(
        self, tokens: list[int], pages: list[int], start: int, prefer: Callable[[list[int], list[int]], bool]
    ) -> list[int]:
        """A request's own pages for tokens the cache already holds (all of `tokens`, whole pages; the
        request computed tokens[start:] itself): every node in that range whose pages `prefer(cached, own)`
        rejects in favour of the request's takes them instead. Returns the pages the caller must free: the
        replaced pages of unlocked nodes, and its own ones the cache did not take. A locked node's replaced
        pages are still read by the requests holding it: they are retired on the node and freed by unlock().

        Route capture uses it: a prefix first cached by a request that did not capture has no routes on the
        host, so every capturing request would recompute it; the first one's pages replace it, even while
        other requests (a long uncaptured decode sharing a system prompt) still hold the old copy."""
        p = self.page_size
        node, i = self.root, 0
        to_free: list[int] = []
        while i < len(tokens):
            child = node.children.get(self._first_page(tokens, i))
            assert child is not None, "adopt: tokens must be cached (insert them first)"
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            if i < start < i + n:  # the request's own range starts inside this node: cut it there
                child = self._split(child, start - i)
                i, node = start, child
                child = node.children[self._first_page(tokens, i)]
                n = len(child.key)
            if i >= start:
                own = pages[i // p : (i + n) // p]
                if prefer(child.pages, own):
                    (child.retired if child.lock_ref > 0 else to_free).extend(child.pages)
                    child.pages = list(own)
                else:
                    to_free.extend(own)
            i += n
            node = child
        return to_free

    def lock(self, node: TreeNode) -> None:
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self.evictable_tokens -= len(cur.key)
                self.locked_tokens += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: TreeNode) -> None:
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref <= 0:
                raise RuntimeError(f"radix node {cur.id} unlocked more often than locked")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self.evictable_tokens += len(cur.key)
                self.locked_tokens -= len(cur.key)
                if cur.retired:  # the last holder of the pages adopt() replaced is done with them
                    self.pool.free(cur.retired)
                    cur.retired = []
            cur = cur.parent

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages from unlocked leaves, least recently used first (fewer if the
        cache has fewer unlocked). Returns the number freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            self.evictable_tokens -= len(leaf.key)
            del parent.children[self._first_page(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def flush(self) -> int:
        """Evict every unlocked node (tests use it to check that the pool is whole again)."""
        return self.evict(self.pool.num_pages)

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
