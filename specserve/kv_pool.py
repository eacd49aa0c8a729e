"""The one paged KV pool shared by the draft and the target model (DESIGN.md §4).

Plain Python bookkeeping: block ids, refcounts and the prefix cache. The K/V tensors live
in the models (`model.make_kv_caches`); every model indexes them with the block ids handed
out here, so one allocation covers both models and a prefix-cache hit restores both.

A block is in exactly one of three states:

- **free**: refcount 0, no hash, in `_free_block_ids` (handed out first);
- **in use**: refcount > 0, hashed or not;
- **evictable**: refcount 0 but hashed (its KV is a cached full block); kept in the LRU
  `_evictable` and evicted oldest-first when the free deque runs dry.

Prefix caching (automatic, vLLM-style): the i-th full block of a sequence is keyed by
`(parent_hash, token_ids of the block)` where `parent_hash` is the hash of block i-1's key
(None for the first block). The dict key keeps the token tuple, so two different blocks
can never share an entry through a hash collision of their own tokens; the chain's parent
hash makes a block's key depend on the whole prefix before it.

A cached block always holds the target's KV; a draft model's may lag behind it (the draft
idles while the controller decodes plainly), so each cached block also records whether the
draft's KV is in it. A hit restores the target's KV on every matched block and the draft's
on the leading run of draft-complete ones; the draft computes the rest beside the prompt's
next chunk, which costs it no more than a miss would, while the target's prefill is saved.
"""

from collections import OrderedDict, deque
from collections.abc import Sequence

BlockKey = tuple[int | None, tuple[int, ...]]   # (parent block hash, token ids of the block)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` positions: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Key of each hashed block, None while the block holds no cached full block.
        self._block_keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}                 # key -> block id
        self._draft_ok = [False] * num_blocks   # a cached block whose draft KV is computed too
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # oldest first
        # Prefix-cache counters for metrics: prompt tokens looked up / found cached.
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # ----- counters -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free + evictable cached blocks."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks registered in the prefix cache (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (evictable cache counts as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    # ----- allocation -----------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks with refcount 1, or None (nothing taken) if too few.

        Plain free blocks go first; only then are cached blocks evicted, least recently
        freed first, so the prefix cache lives as long as memory allows.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._uncache(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block (e.g. a finished sequence's block table).

        Blocks are released last to first: a sequence's tail blocks then sit older in the
        LRU than its head, and are evicted first. A cached head without its tail is still a
        usable prefix; a tail without its head is not.
        """
        for block_id in reversed(block_ids):
            ref_count = self.ref_counts[block_id]
            if ref_count <= 0:
                raise ValueError(f"free of block {block_id} whose refcount is already 0 (double free)")
            self.ref_counts[block_id] = ref_count - 1
            if ref_count == 1:
                if self._block_keys[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)

    # ----- prefix cache ---------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest run of cached full blocks that starts `token_ids`; takes a ref on each.

        Returns (block_ids, num_cached_tokens), num_cached_tokens = len(block_ids) * BS.
        Never covers the last token: at least one token is computed, so logits exist.
        The caller owns the refs: on a failed admission it must `free(block_ids)`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs if token_ids else 0
        block_ids: list[int] = []
        parent_hash: int | None = None
        for i in range(max_blocks):
            key = (parent_hash, tuple(token_ids[i * bs : (i + 1) * bs]))
            block_id = self._cached.get(key)
            if block_id is None:
                break
            block_ids.append(block_id)
            parent_hash = hash(key)
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1
        num_cached_tokens = len(block_ids) * bs
        self.prefix_cache_query_tokens += len(token_ids)
        self.prefix_cache_hit_tokens += num_cached_tokens
        return block_ids, num_cached_tokens

    def draft_cached_tokens(self, block_ids: Sequence[int]) -> int:
        """Tokens at the head of a `match_prefix` result whose draft KV is cached too."""
        n = 0
        while n < len(block_ids) and self._draft_ok[block_ids[n]]:
            n += 1
        return n * self.block_size

    def mark_draft(self, block_ids: Sequence[int]) -> None:
        """The draft's KV of these blocks is computed now; the cached ones record it."""
        for block_id in block_ids:
            if self._block_keys[block_id] is not None:
                self._draft_ok[block_id] = True

    def cache_blocks(
        self,
        block_hashes: list[int],
        block_table: Sequence[int],
        token_ids: Sequence[int],
        num_tokens: int,
    ) -> None:
        """Register the sequence's full blocks among its first `num_tokens` tokens.

        `num_tokens` counts only tokens whose target KV is computed (never speculative
        scratch); a block enters without its draft KV (`mark_draft`). `block_hashes` is the sequence's own list, one hash per block already
        registered; it is extended in place, so each block is hashed once. Blocks obtained
        from `match_prefix` are simply recognised as already cached.
        If an identical block is already cached under another id (two sequences computed the
        same prefix at once), the existing entry is kept and this block stays private: it
        is freed, not cached, when the sequence ends.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens // bs, len(block_table))
        for i in range(len(block_hashes), num_full):
            parent_hash = block_hashes[i - 1] if i > 0 else None
            key = (parent_hash, tuple(token_ids[i * bs : (i + 1) * bs]))
            block_id = block_table[i]
            own_key = self._block_keys[block_id]
            if own_key is not None:
                assert own_key == key, (
                    f"block {block_id} is cached with other tokens than position {i * bs}.. of this sequence"
                )
            elif key not in self._cached:
                self._cached[key] = block_id
                self._block_keys[block_id] = key
                self._draft_ok[block_id] = False
            block_hashes.append(hash(key))

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block (they become plain free blocks); returns how many.

        Blocks still in use keep their entries, so running sequences are unaffected.
        """
        num_dropped = len(self._evictable)
        for block_id in self._evictable:
            self._uncache(block_id)
            self._free_block_ids.append(block_id)
        self._evictable.clear()
        return num_dropped

    def _uncache(self, block_id: int) -> None:
        key = self._block_keys[block_id]
        self._block_keys[block_id] = None
        self._draft_ok[block_id] = False
        if key is not None and self._cached.get(key) == block_id:
            del self._cached[key]

    # ----- checks ---------------------------------------------------------------------

    def check_all_free(self) -> None:
        """Raise AssertionError naming every block still referenced (a leak)."""
        leaked = {b: rc for b, rc in enumerate(self.ref_counts) if rc != 0}
        if leaked:
            shown = ", ".join(f"block {b} (refcount {rc})" for b, rc in list(leaked.items())[:32])
            more = f" and {len(leaked) - 32} more" if len(leaked) > 32 else ""
            raise AssertionError(f"{len(leaked)} KV blocks not freed: {shown}{more}")

    def check_consistency(self) -> None:
        """Assert the pool's internal invariants (for tests and debugging; O(num_blocks))."""
        free = set(self._free_block_ids)
        evictable = set(self._evictable)
        assert len(free) == len(self._free_block_ids), "a block is twice in the free deque"
        assert not free & evictable, f"blocks both free and evictable: {sorted(free & evictable)}"
        for block_id in range(self.num_blocks):
            rc, key = self.ref_counts[block_id], self._block_keys[block_id]
            assert rc >= 0, f"block {block_id} has refcount {rc}"
            if rc > 0:
                assert block_id not in free and block_id not in evictable, f"block {block_id} in use and free"
            elif key is None:
                assert block_id in free, f"unhashed block {block_id} with refcount 0 is not free"
            else:
                assert block_id in evictable, f"cached block {block_id} with refcount 0 is not evictable"
            if key is not None:
                assert self._cached.get(key) == block_id, f"block {block_id} has a key not mapped to it"
            else:
                assert not self._draft_ok[block_id], f"uncached block {block_id} is marked draft-complete"
        for key, block_id in self._cached.items():
            assert self._block_keys[block_id] == key, f"cache entry for block {block_id} does not match its key"
