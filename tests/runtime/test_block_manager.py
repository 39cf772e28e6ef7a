"""BlockManager: ref counts, free list and prefix sharing under random allocate/append/rollback/free."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.block_manager import BlockManager
from runtime.sequence import SamplingParams, Sequence

BS = 4


def make_seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(f"r{i}", list(tokens), SamplingParams())


class FakePool:
    """Stands in for the KV pool: each slot remembers which context it was computed for."""

    def __init__(self, bm: BlockManager):
        self.bm, self.slots = bm, {}

    def slot(self, seq: Sequence, p: int) -> int:
        return seq.block_table[p // self.bm.block_size] * self.bm.block_size + p % self.bm.block_size

    def compute(self, seq: Sequence, end: int, commit: bool = True) -> None:
        """'Run the model' on positions [num_computed, end) and commit the blocks."""
        for p in range(seq.num_computed_tokens, end):
            self.slots[self.slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = end
        if commit:
            self.bm.commit(seq, end)

    def check(self, seq: Sequence) -> None:
        for p in range(seq.num_computed_tokens):
            assert self.slots[self.slot(seq, p)] == tuple(seq.token_ids[: p + 1]), (seq.request_id, p)


def test_prefix_blocks_are_shared_and_never_the_last_token():
    bm = BlockManager(num_blocks=10, block_size=BS)
    pool = FakePool(bm)
    a = make_seq(0, list(range(10)))  # 2 full blocks + 2 tokens
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and len(a.block_table) == 3
    pool.compute(a, a.num_tokens)
    b = make_seq(1, list(range(9)) + [99])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = make_seq(2, list(range(8)))  # exactly two full blocks: the second must still be computed
    bm.allocate(c)
    assert c.num_cached_tokens == 4
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 10
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    # freed full blocks stay cached: a new request with the prefix still hits them
    d = make_seq(3, list(range(9)))
    bm.allocate(d)
    assert d.num_cached_tokens == 8


def test_uncommitted_blocks_are_not_shared():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_seq(0, list(range(12)))
    bm.allocate(a)  # KV not computed yet: nothing registered
    b = make_seq(1, list(range(12)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    pool = FakePool(bm)
    a = make_seq(0, list(range(9)))
    bm.allocate(a)
    pool.compute(a, 9)
    b = make_seq(1, list(range(9)))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not bm.hash_to_block


def test_truncate_rolls_back_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    pool = FakePool(bm)
    s = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(s)
    pool.compute(s, 4)  # decode state: last token pending
    assert bm.can_append(s, 1 + 6)
    bm.append_slots(s, 1 + 6)  # 4 + 7 = 11 slots -> 3 blocks
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    bm.truncate(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants([s])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(3, 24), caching=st.booleans())
def test_random_operations_keep_invariants(seed, num_blocks, caching):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    pool = FakePool(bm)
    live: list[Sequence] = []
    for i in range(60):
        op = rng.random()
        if op < 0.35:  # a new request, often sharing a prefix with earlier ones
            seq = make_seq(i, [rng.randrange(2) for _ in range(rng.randint(1, 14))])
            if bm.can_allocate(seq):
                free_before = bm.num_free_blocks
                bm.allocate(seq)
                assert bm.num_free_blocks <= free_before
                assert len(seq.block_table) == bm.blocks_for(seq.num_tokens)
                assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < seq.num_tokens
                pool.check(seq)  # cached blocks hold exactly this prefix's KV
                pool.compute(seq, seq.num_tokens)
                seq.token_ids.append(rng.randrange(2))
                live.append(seq)
        elif op < 0.8 and live:  # a (speculative) decode step with k drafts, a of them accepted
            seq = rng.choice(live)
            k = rng.randint(0, 3)
            if bm.can_append(seq, 1 + k):
                bm.append_slots(seq, 1 + k)
                assert len(seq.block_table) * BS >= seq.num_computed_tokens + 1 + k
                a = rng.randint(0, k)
                drafts = [rng.randrange(2) for _ in range(k)]
                seq.token_ids.extend(drafts)  # computed as if all were right...
                pool.compute(seq, seq.num_tokens, commit=False)
                del seq.token_ids[len(seq.token_ids) - k + a:]  # ...then rolled back
                seq.num_computed_tokens = seq.num_tokens
                bm.commit(seq, seq.num_computed_tokens)
                seq.token_ids.append(rng.randrange(2))
                bm.truncate(seq, seq.num_computed_tokens)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            assert not seq.block_table
        bm.check_invariants(live)
        for seq in live:
            pool.check(seq)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("n", [1, 4, 5, 16])
def test_blocks_for(n):
    assert BlockManager(4, BS).blocks_for(n) == -(-n // BS)
