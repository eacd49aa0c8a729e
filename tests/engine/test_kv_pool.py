"""KVPool: allocation, refcounts, prefix caching, LRU eviction and leak detection."""

import random

import pytest

from specserve.kv_pool import KVPool, blocks_needed

BS = 4


def run_prompt(pool, token_ids):
    """Admit a prompt the way the scheduler does: match, allocate the rest, cache when computed."""
    cached_ids, num_cached = pool.match_prefix(token_ids)
    new_ids = pool.allocate(blocks_needed(len(token_ids), pool.block_size) - len(cached_ids))
    assert new_ids is not None
    block_table = cached_ids + new_ids
    block_hashes = []
    pool.cache_blocks(block_hashes, block_table, token_ids, len(token_ids))
    return block_table, block_hashes, num_cached


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_free_round_trip():
    pool = KVPool(8, BS)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    pool.free(a)
    assert pool.num_free_blocks == 3 and pool.usage == pytest.approx(5 / 8)
    pool.free(b)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_all_free()
    pool.check_consistency()


def test_exhaustion_returns_none_and_takes_nothing():
    pool = KVPool(4, BS)
    held = pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1          # the failed call took nothing
    assert pool.allocate(0) == []
    last = pool.allocate(1)
    assert pool.allocate(1) is None
    pool.free(held + last)
    pool.check_all_free()


def test_double_free_raises():
    pool = KVPool(4, BS)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError, match="block"):
        pool.free(ids)


def test_prefix_hit_after_first_sequence_frees():
    pool = KVPool(16, BS)
    prompt = list(range(100, 111))                    # 11 tokens: 2 full blocks + 3
    table1, hashes1, num_cached = run_prompt(pool, prompt)
    assert num_cached == 0 and len(hashes1) == 2
    assert pool.num_cached_blocks == 2
    pool.free(table1)
    assert pool.num_free_blocks == 16                  # cached blocks are still allocatable
    # Same first 8 tokens, different tail: both full blocks are reused.
    ids, num = pool.match_prefix(prompt[:8] + [7, 7])
    assert ids == table1[:2] and num == 8
    assert pool.ref_counts[ids[0]] == 1 and pool.num_evictable_blocks == 0
    assert pool.prefix_cache_hit_tokens == 8 and pool.prefix_cache_query_tokens == 11 + 10
    pool.free(ids)
    pool.check_all_free()
    pool.check_consistency()


def test_match_never_covers_last_token():
    pool = KVPool(8, BS)
    prompt = list(range(8))                            # exactly 2 full blocks
    table, _, _ = run_prompt(pool, prompt)
    pool.free(table)
    ids, num = pool.match_prefix(prompt)
    assert num == 4 and ids == table[:1]               # block 2 would cover the last token
    pool.free(ids)
    ids, num = pool.match_prefix(prompt + [99])
    assert num == 8 and ids == table
    pool.free(ids)
    assert pool.match_prefix([]) == ([], 0)


def test_partial_block_prompt_does_not_hit():
    pool = KVPool(8, BS)
    table, hashes, _ = run_prompt(pool, [1, 2, 3])     # less than one block: nothing cached
    assert hashes == [] and pool.num_cached_blocks == 0
    pool.free(table)
    assert pool.match_prefix([1, 2, 3, 4, 5]) == ([], 0)
    # A different first block misses even when later blocks agree (the key chains the parent).
    table, _, _ = run_prompt(pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    pool.free(table)
    assert pool.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]) == ([], 0)


def test_lru_evicts_least_recently_freed_first():
    pool = KVPool(4, BS)
    seqs = [[s * 10 + i for i in range(BS)] + [0] for s in range(4)]   # one full block each
    tables = []
    for s in seqs[:2]:
        table, _, _ = run_prompt(pool, s)
        tables.append(table)
    pool.free(tables[1])                 # seq 1's block freed first -> oldest in the LRU
    pool.free(tables[0])
    assert pool.num_evictable_blocks == 2
    # 4 blocks: 2 free, 2 evictable. Allocating 3 uses both free ones, then evicts seq 1's.
    new = pool.allocate(3)
    assert tables[1][0] in new and tables[0][0] not in new
    assert pool.match_prefix(seqs[1])[1] == 0
    ids, num = pool.match_prefix(seqs[0])
    assert num == BS
    pool.free(ids + new)
    pool.check_all_free()
    pool.check_consistency()


def test_free_releases_tail_before_head():
    pool = KVPool(3, BS)
    prompt = list(range(3 * BS))
    table, _, _ = run_prompt(pool, prompt)
    pool.free(table)
    pool.allocate(1)                     # evicts one cached block: must be the tail
    ids, num = pool.match_prefix(prompt)
    assert ids == table[:2] and num == 2 * BS


def test_refcount_shared_by_two_sequences():
    pool = KVPool(8, BS)
    prompt = list(range(9))
    table_a, _, _ = run_prompt(pool, prompt)
    table_b, hashes_b, num = run_prompt(pool, prompt[:8] + [50, 51])
    assert num == 8 and table_b[:2] == table_a[:2]
    assert [pool.ref_counts[b] for b in table_a[:2]] == [2, 2]
    assert len(hashes_b) == 2
    pool.free(table_a)
    assert [pool.ref_counts[b] for b in table_b[:2]] == [1, 1]
    assert pool.num_free_blocks == 8 - 3               # b still holds 3 blocks
    pool.free(table_b)
    pool.check_all_free()


def test_duplicate_block_keeps_existing_entry():
    pool = KVPool(8, BS)
    prompt = list(range(5))
    # Two sequences compute the same block before either caches it.
    table_a = pool.allocate(2)
    table_b = pool.allocate(2)
    hashes_a, hashes_b = [], []
    pool.cache_blocks(hashes_a, table_a, prompt, 5)
    pool.cache_blocks(hashes_b, table_b, prompt, 5)
    assert hashes_a == hashes_b and pool.num_cached_blocks == 1
    pool.free(table_b)                                  # b's duplicate is a plain free block
    assert pool.num_evictable_blocks == 0
    pool.free(table_a)
    assert pool.num_evictable_blocks == 1
    assert pool.match_prefix(prompt) == ([table_a[0]], BS)
    pool.check_consistency()


def test_cache_blocks_is_incremental():
    pool = KVPool(8, BS)
    tokens = list(range(20, 30))
    table = pool.allocate(3)
    hashes = []
    pool.cache_blocks(hashes, table, tokens, 3)         # no full block yet
    assert hashes == []
    pool.cache_blocks(hashes, table, tokens, 7)
    assert len(hashes) == 1 and pool.num_cached_blocks == 1
    pool.cache_blocks(hashes, table, tokens, 10)
    assert len(hashes) == 2 and pool.num_cached_blocks == 2
    pool.free(table)
    assert pool.match_prefix(tokens + [1])[1] == 8


def test_reset_prefix_cache():
    pool = KVPool(8, BS)
    table_a, _, _ = run_prompt(pool, list(range(9)))
    table_b, _, _ = run_prompt(pool, list(range(50, 59)))
    pool.free(table_a)
    assert pool.reset_prefix_cache() == 2               # b's blocks are in use: kept
    assert pool.num_cached_blocks == 2
    assert pool.match_prefix(list(range(9)))[1] == 0
    pool.free(table_b)
    pool.check_consistency()


def test_check_all_free_names_leaked_blocks():
    pool = KVPool(6, BS)
    a = pool.allocate(2)
    b = pool.allocate(1)
    pool.free(a)
    with pytest.raises(AssertionError, match=rf"block {b[0]} \(refcount 1\)"):
        pool.check_all_free()
    pool.free(b)
    pool.check_all_free()


def test_prefix_caching_disabled():
    pool = KVPool(8, BS, enable_prefix_caching=False)
    table, hashes, _ = run_prompt(pool, list(range(9)))
    assert hashes == [] and pool.num_cached_blocks == 0
    pool.free(table)
    assert pool.match_prefix(list(range(9))) == ([], 0)
    assert pool.num_evictable_blocks == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    pool = KVPool(24, BS)
    # Prompts from a few shared stems so prefix hits are frequent.
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live = []   # (tokens, block_table, block_hashes, num_computed)
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            tokens = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            if not tokens:
                continue
            cached, num_cached = pool.match_prefix(tokens)
            assert num_cached < len(tokens) and num_cached == len(cached) * BS
            for i, block_id in enumerate(cached):      # a hit really holds those tokens
                assert pool._block_keys[block_id][1] == tuple(tokens[i * BS : (i + 1) * BS])
            new = pool.allocate(blocks_needed(len(tokens), BS) - len(cached))
            if new is None:
                pool.free(cached)
            else:
                live.append([tokens, cached + new, [], num_cached])
        elif op < 0.55 and live:
            seq = rng.choice(live)                       # compute some more tokens
            seq[3] = rng.randint(seq[3], len(seq[0]))
            pool.cache_blocks(seq[2], seq[1], seq[0], seq[3])
        elif op < 0.7 and live:
            seq = rng.choice(live)                       # decode: grow by a token
            if len(seq[0]) % BS == 0:
                more = pool.allocate(1)
                if more is None:
                    continue
                seq[1] += more
            seq[0] = seq[0] + [rng.randrange(5)]
        elif op < 0.95 and live:
            seq = live.pop(rng.randrange(len(live)))
            pool.free(seq[1])
        else:
            pool.reset_prefix_cache()
        pool.check_consistency()
        held = sum(1 for rc in pool.ref_counts if rc > 0)
        assert pool.num_free_blocks == pool.num_blocks - held
        assert pool.num_evictable_blocks <= pool.num_cached_blocks
    for seq in live:
        pool.free(seq[1])
    pool.check_consistency()
    pool.check_all_free()
    assert pool.num_free_blocks == pool.num_blocks
    assert pool.prefix_cache_hit_tokens > 0
