"""BlockManager: all-or-nothing allocation, prefix hits sharing blocks, LRU eviction, verified hits, commits."""

import pytest

from anygpu.engine import BlockManager, Sequence
from anygpu.engine import block_manager as bm_module
from anygpu.engine.block_manager import hash_block


def computed(bm, seq, n=None):
    """Pretend the model computed seq up to n tokens (all by default), then commit."""
    seq.num_computed_tokens = seq.num_tokens if n is None else n
    bm.commit(seq)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence(range(10))
    assert bm.allocate(a) and len(a.block_table) == 3 and a.num_computed_tokens == 0
    assert bm.num_free_blocks == 1 and bm.usage == 0.75
    b = Sequence(range(100, 109))
    refs = list(bm.ref_counts)
    assert not bm.allocate(b)
    assert b.block_table == [] and b.num_computed_tokens == 0 and bm.ref_counts == refs and bm.num_free_blocks == 1
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0 and a.block_table == []


def test_prefix_hits_share_blocks_and_count_references():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence(list(range(8)) + [50, 51, 52])
    assert bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.ref_counts[x] for x in b.block_table] == [2, 2, 1]
    shared = a.block_table[:2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table] == [2 - 1, 1, 1] and bm.num_free_blocks == 10 - 3
    bm.free(b)
    assert bm.num_free_blocks == 10 and all(r == 0 for r in bm.ref_counts)
    # Freed blocks keep their hashes: a new request revives them from the free list.
    c = Sequence(list(range(9)))
    assert bm.allocate(c) and c.block_table[:2] == shared and c.num_computed_tokens == 8
    assert bm.num_free_blocks == 10 - 3


def test_the_last_token_is_never_cached():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(list(range(12)))
    bm.allocate(a)
    computed(bm, a)  # three full blocks registered
    assert len(bm.hash_to_block) == 3
    for n, hit in ((12, 8), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0)):
        s = Sequence(list(range(n)))
        assert bm.allocate(s)
        assert s.num_computed_tokens == hit < s.num_tokens, n
        bm.free(s)


def test_lru_eviction_takes_unhashed_blocks_then_the_oldest_prefix_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = Sequence([1, 2, 3, 4, 5]), Sequence([6, 7, 8, 9, 10])
    for s in (a, b):  # one after the other: A freed before B
        assert bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    ha0 = hash_block(b"", (1, 2))
    ha1, hb0 = hash_block(ha0, (3, 4)), hash_block(b"", (6, 7))
    hb1 = hash_block(hb0, (8, 9))
    assert {ha0, ha1, hb0, hb1} == set(bm.hash_to_block)
    c = Sequence(list(range(20, 26)))  # 3 fresh blocks: the 2 unhashed ones, then A's tail block
    assert bm.allocate(c)
    assert set(bm.hash_to_block) == {ha0, hb0, hb1}
    assert all(bm.block_hash[x] is None for x in c.block_table)
    d = Sequence([1, 2, 3, 4, 5])  # A's head block is still there
    assert bm.allocate(d) and d.num_computed_tokens == 2


def test_a_hash_hit_is_verified_against_the_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: b"collision")
    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    b = Sequence([9, 9, 3, 4, 5])  # same (fake) hash as A's first block, other tokens
    assert bm.allocate(b) and b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    c = Sequence([1, 2, 7, 7, 7])  # same tokens: a true hit
    assert bm.allocate(c) and c.num_computed_tokens == 2 and c.block_table[0] == a.block_table[0]


def test_commit_registers_only_full_fully_computed_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence(list(range(10)))
    bm.allocate(a)
    computed(bm, a, 7)  # chunked prefill: block 0 full and computed, block 1 half computed
    assert len(bm.hash_to_block) == 1 and len(a.block_hashes) == 1
    b = Sequence(list(range(10)))
    assert bm.allocate(b) and b.num_computed_tokens == 4
    computed(bm, a)  # the rest of the prompt: block 1 too; block 2 holds 2 tokens, not full
    assert len(bm.hash_to_block) == 2
    for token in (10, 11):  # decode two tokens: block 2 fills, but its last token is not computed yet
        a.output_token_ids.append(token)
        assert bm.ensure_slots(a, 1)
    computed(bm, a, 11)
    assert len(bm.hash_to_block) == 2
    computed(bm, a, 12)
    assert len(bm.hash_to_block) == 3 and bm.block_hash[a.block_table[2]] is not None
    c = Sequence(list(range(12)) + [99])  # a hit through the output tokens
    assert bm.allocate(c) and c.num_computed_tokens == 12 and c.block_table[:3] == a.block_table


def test_a_prefix_computed_twice_is_registered_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = Sequence([1, 2, 3]), Sequence([1, 2, 4])
    bm.allocate(a)
    bm.allocate(b)  # before A committed: no hit, its own block
    computed(bm, a)
    computed(bm, b)
    assert bm.hash_to_block == {hash_block(b"", (1, 2)): a.block_table[0]}
    assert bm.block_hash[b.block_table[0]] is None
    first = a.block_table[0]
    bm.free(a)
    bm.free(b)
    c = Sequence([1, 2, 5])
    assert bm.allocate(c) and c.block_table[0] == first and c.num_computed_tokens == 2


def test_ensure_slots_grows_the_table_append_only_and_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Sequence(range(4))
    bm.allocate(a)
    a.num_computed_tokens = 4
    table = list(a.block_table)
    assert bm.ensure_slots(a, 0) and a.block_table == table
    assert bm.ensure_slots(a, 4) and a.block_table[:1] == table and len(a.block_table) == 2
    table = list(a.block_table)
    assert bm.ensure_slots(a, 8) and a.block_table[:2] == table and len(a.block_table) == 3
    table = list(a.block_table)
    assert not bm.ensure_slots(a, 9)  # 13 tokens: 4 blocks, the pool has 3
    assert a.block_table == table and bm.num_free_blocks == 0


def test_prefix_caching_can_be_turned_off_and_bad_sizes_raise():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Sequence([1, 2, 3])
    bm.allocate(a)
    computed(bm, a)
    b = Sequence([1, 2, 3])
    assert bm.allocate(b) and b.num_computed_tokens == 0 and not bm.hash_to_block
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, 0)
