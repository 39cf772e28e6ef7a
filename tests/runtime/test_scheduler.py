"""Scheduler: admission order, token budget, chunked prefill, preemption order, and progress under KV pressure."""
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.block_manager import BlockManager
from runtime.scheduler import Scheduler
from runtime.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4


def seq(i: int, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(f"r{i}", [(i * 7 + j) % 50 + 1 for j in range(n)], SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler, batch, next_token=lambda s: (sum(s.token_ids) * 31) % 97):
    """What the engine does after a forward, minus the model: advance, append, finish."""
    for item in batch:
        s = item.seq
        s.num_computed_tokens += item.num_new_tokens
        if item.completes:
            s.token_ids.append(next_token(s))
        sched.bm.commit(s, s.num_computed_tokens)
        sched.bm.truncate(s, s.num_tokens)  # give back unused lookahead
        if s.num_completion_tokens >= s.params.max_tokens:
            sched.finish(s, "length")


def test_admission_is_fcfs_and_respects_limits():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [seq(i, 5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [b.seq for b in batch] == seqs[:2]  # max_num_seqs
    assert all(b.num_new_tokens == 5 and b.completes for b in batch)
    assert seqs[2].status is SequenceStatus.WAITING
    run_step(sched, batch)
    batch = sched.schedule()
    assert [(b.seq, b.num_new_tokens) for b in batch] == [(seqs[0], 1), (seqs[1], 1)]


def test_chunked_prefill_and_budget():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    long, short = seq(0, 40), seq(1, 3)
    sched.add(long)
    sched.add(short)
    chunks = []
    for _ in range(3):
        batch = sched.schedule()
        assert sum(b.num_new_tokens + b.lookahead for b in batch) <= 16
        chunks.append([(b.seq.request_id, b.num_new_tokens, b.completes) for b in batch])
        run_step(sched, batch)
    assert chunks[0] == [("r0", 16, False)]
    assert chunks[1] == [("r0", 16, False)]
    assert chunks[2] == [("r0", 8, True), ("r1", 3, True)]  # leftover budget admits the next prompt
    assert long.num_completion_tokens == 1


def test_lookahead_slots_are_reserved_for_decoding_sequences():
    bm = BlockManager(num_blocks=100, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, lookahead=3)
    s = seq(0, 4)
    sched.add(s)
    batch = sched.schedule()
    assert batch[0].lookahead == 0  # prefill: no drafts
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch[0].num_new_tokens == 1 and batch[0].lookahead == 3
    assert len(s.block_table) * BS >= s.num_computed_tokens + 4


def test_preemption_takes_the_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = seq(0, 8, 6), seq(1, 8, 6), seq(2, 8, 6)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()  # 2 blocks each: all three admitted
    assert len(batch) == 3 and bm.num_free_blocks == 0
    run_step(sched, batch)  # each now has 9 tokens, KV for 8
    batch = sched.schedule()  # a needs slot 8 -> a third block: c (newest) is preempted
    assert c.status is SequenceStatus.WAITING and sched.waiting[0] is c and c.num_preemptions == 1
    assert [x.seq for x in batch] == [a, b] and not c.block_table and c.num_computed_tokens == 0
    run_step(sched, batch)
    # no admission while under pressure; when a finishes, c comes back and recomputes all its tokens
    for _ in range(100):
        if a.status is SequenceStatus.FINISHED:
            break
        batch = sched.schedule()
        assert c not in [x.seq for x in batch] or c.status is SequenceStatus.RUNNING
        run_step(sched, batch)
    assert a.status is SequenceStatus.FINISHED
    assert c.num_tokens == 9 and sched.num_preemptions >= 1


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 40), budget=st.integers(4, 48),
       lookahead=st.integers(0, 3), caching=st.booleans())
def test_every_request_finishes_under_kv_pressure(seed, num_blocks, budget, lookahead, caching):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget, lookahead=lookahead)
    capacity = num_blocks * BS - lookahead  # what the engine guarantees as max_model_len
    seqs = []
    for i in range(rng.randint(1, 10)):
        n = rng.randint(1, min(20, capacity - 1))
        s = seq(i, n, max_tokens=rng.randint(1, max(1, min(12, capacity - n))))
        seqs.append(s)
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch, "scheduler made no progress"
        assert sum(b.num_new_tokens + b.lookahead for b in batch) <= budget
        run_step(sched, batch)
        bm.check_invariants(sched.running)
    assert not sched.has_unfinished()
    assert all(s.num_completion_tokens == s.params.max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks
