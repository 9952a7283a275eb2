"""Paged KV block accounting over depth planes, with a prefix cache of full prompt pages.

Mechanism only: the pool reports room and edits block tables; it never looks at priority, and
"no room" is a normal return value (``None``/``False``), not an error.

A **page** is ``block_size`` positions of a request at every plane: ``num_planes`` physical blocks
(LAST_EXITED keeps one plane per loop depth; a plain model has one). All planes grow together, so
a page is the unit of allocation and of sharing; block counts are ``pages × num_planes``.

Reference counts: one per request table holding the page, plus one while the prefix cache holds
it. A cached page held by nobody else is *evictable*: it counts as free and is reclaimed in LRU
order only when a claim has already been checked to fit (a failed claim evicts nothing).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvgate.protocol import capacity

Page = tuple[int, ...]  # one block id per plane


def page_hashes(token_ids: Sequence[int], block_size: int) -> tuple[bytes, ...]:
    """Chained digests of the full pages of ``token_ids[:-1]`` (the last prompt token is never
    cached: sampling needs its hidden state, which the cache does not keep)."""
    digests: list[bytes] = []
    parent = b""
    usable = len(token_ids) - 1
    for start in range(0, usable - block_size + 1, block_size):
        page = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        digests.append(parent)
    return tuple(digests)


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, num_planes: int, enable_prefix_caching: bool
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_planes
        self.enable_prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: low ids first
        self._refs: list[int] = [0] * num_blocks
        self._tables: dict[str, list[Page]] = {}
        self._cache: dict[bytes, Page] = {}
        self._cached_digest: dict[int, bytes] = {}  # first block of a cached page -> digest
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # LRU first

    # --- views -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a claim can use: unreferenced plus evictable cached pages."""
        return len(self._free) + len(self._evictable) * self.num_planes

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def pages_for(self, num_tokens: int) -> int:
        return capacity.pages_for(num_tokens, self.block_size)

    def num_pages(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table) if table is not None else 0

    def has_table(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> list[Page]:
        return self._tables[request_id]

    def lookup_prefix(self, digests: Sequence[bytes]) -> list[Page]:
        """Longest cached run of ``digests``; refreshes their LRU position."""
        if not self.enable_prefix_caching:
            return []
        found: list[Page] = []
        for digest in digests:
            page = self._cache.get(digest)
            if page is None:
                break
            if digest in self._evictable:
                self._evictable.move_to_end(digest)
            found.append(page)
        return found

    def cached_prefix_pages(self, digests: Sequence[bytes]) -> int:
        """How many leading pages of ``digests`` the cache holds (a probe: no LRU change)."""
        if not self.enable_prefix_caching:
            return 0
        count = 0
        for digest in digests:
            if digest not in self._cache:
                break
            count += 1
        return count

    def cached_digests(self) -> frozenset[bytes]:
        """Every digest the cache holds (what a router fed by KV-cache events would know)."""
        return frozenset(self._cache)

    def claim_cost(self, num_new_pages: int, prefix: Sequence[Page]) -> int:
        """How much ``num_free_blocks`` drops if a table takes ``prefix`` and new pages."""
        evictable_prefix = sum(1 for page in prefix if self._refs[page[0]] == 1)
        return (num_new_pages + evictable_prefix) * self.num_planes

    def reclaimable_blocks(self, request_id: str, keep: Collection[Page] = ()) -> int:
        """How much ``num_free_blocks`` grows if ``request_id`` releases its table, not counting
        pages in ``keep`` (a requester's own prefix: freeing them would only make its claim of
        them cost as much as they free)."""
        pages = 0
        for page in self._tables.get(request_id, ()):
            if page in keep:
                continue
            refs = self._refs[page[0]]
            if refs == 1 or (refs == 2 and page[0] in self._cached_digest):
                pages += 1
        return pages * self.num_planes

    # --- mutation ----------------------------------------------------------------------------
    def allocate(
        self, request_id: str, num_pages: int, prefix: Sequence[Page]
    ) -> list[Page] | None:
        """Create a table of ``prefix`` + fresh pages (``num_pages`` in all), atomically.

        Returns the fresh pages, or ``None`` (nothing changed) when they do not fit."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has a block table")
        if len(prefix) > num_pages:
            raise ValueError("prefix longer than the requested table")
        if self.claim_cost(num_pages - len(prefix), prefix) > self.num_free_blocks:
            return None
        for page in prefix:
            self._incref(page)
        fresh = self._claim(num_pages - len(prefix))
        self._tables[request_id] = [*prefix, *fresh]
        return fresh

    def grow(self, request_id: str, num_pages: int) -> list[Page] | None:
        """Extend a table to ``num_pages``; returns the new pages or ``None`` (no change)."""
        table = self._tables[request_id]
        missing = num_pages - len(table)
        if missing <= 0:
            return []
        if missing * self.num_planes > self.num_free_blocks:
            return None
        fresh = self._claim(missing)
        table.extend(fresh)
        return fresh

    def release(self, request_id: str) -> list[Page]:
        """Drop a request's table; returns its pages (a snapshot is taken of them)."""
        table = self._tables.pop(request_id, [])
        for page in table:
            self._decref(page)
        return table

    def publish(self, request_id: str, digests: Sequence[bytes], num_pages: int) -> None:
        """Offer the first ``num_pages`` pages of a table (K/V complete at every plane) to the
        prefix cache under ``digests``."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        for index in range(min(num_pages, len(digests), len(table))):
            digest, page = digests[index], table[index]
            if digest in self._cache or page[0] in self._cached_digest:
                continue
            self._cache[digest] = page
            self._cached_digest[page[0]] = digest
            self._incref(page)

    def check(self) -> list[str]:
        """Conservation audit: every block counted once, references match holders."""
        problems: list[str] = []
        expected = [0] * self.num_blocks
        for table in self._tables.values():
            for page in table:
                for block in page:
                    expected[block] += 1
        for page in self._cache.values():
            for block in page:
                expected[block] += 1
        if expected != self._refs:
            bad = [b for b in range(self.num_blocks) if expected[b] != self._refs[b]][:8]
            problems.append(f"reference counts disagree with holders for blocks {bad}")
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if any(self._refs[b] for b in free):
            problems.append("a referenced block is on the free list")
        held = sum(1 for r in self._refs if r)
        if held + len(self._free) != self.num_blocks:
            problems.append(f"free ({len(self._free)}) + held ({held}) != {self.num_blocks}")
        for digest in self._evictable:
            if self._refs[self._cache[digest][0]] != 1:
                problems.append("an evictable cached page is still held by a request")
                break
        return problems

    # --- internals ---------------------------------------------------------------------------
    def _claim(self, num_pages: int) -> list[Page]:
        planes = self.num_planes
        needed = num_pages * planes
        free = self._free
        while len(free) < needed:
            self._evict_one()
        # The top of the free stack, in the order it pops (lowest ids first).
        top = len(free) - needed
        blocks = free[top:]
        del free[top:]
        blocks.reverse()
        for block in blocks:
            self._refs[block] = 1
        return [tuple(blocks[first : first + planes]) for first in range(0, needed, planes)]

    def _evict_one(self) -> None:
        digest, _ = self._evictable.popitem(last=False)
        page = self._cache.pop(digest)
        del self._cached_digest[page[0]]
        for block in page:
            self._refs[block] = 0
            self._free.append(block)

    def _incref(self, page: Page) -> None:
        if self._refs[page[0]] == 1:
            digest = self._cached_digest.get(page[0])
            if digest is not None:
                self._evictable.pop(digest, None)
        for block in page:
            self._refs[block] += 1

    def _decref(self, page: Page) -> None:
        refs = self._refs[page[0]] - 1
        for block in page:
            self._refs[block] = refs
        if refs == 0:
            self._free.extend(page)
        elif refs == 1:
            digest = self._cached_digest.get(page[0])
            if digest is not None:
                self._evictable[digest] = None
