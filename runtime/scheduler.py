"""Iteration-level continuous batching over a paged KV cache (no torch).

Every ``schedule()`` builds one forward: first the running sequences, oldest first (a decoding one
needs one token, plus ``lookahead`` reserved slots for speculative drafts; one still in prefill gets
its next chunk), then waiting sequences are admitted as long as blocks, the token budget
(``max_num_batched_tokens``) and ``max_num_seqs`` allow. A prompt longer than the remaining budget
is prefilled in chunks over several steps. When a running sequence needs a block and none is free,
the newest running sequence is preempted by recompute: its blocks are freed and it goes back to the
front of the queue (prefix caching usually makes the recompute cheap). Nothing is admitted in a
step that preempted, so the pool cannot thrash, and a sequence alone in the pool always fits
because the engine caps ``max_model_len`` by the pool size.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """One sequence's share of a forward: tokens ``[num_computed, num_computed + num_new_tokens)``."""

    seq: Sequence
    num_new_tokens: int
    lookahead: int = 0  # KV slots reserved past the last token for drafted tokens
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled
    completes: bool = field(init=False)  # the chunk reaches the last token: the forward yields a new token

    def __post_init__(self):
        self.start = self.seq.num_computed_tokens
        self.completes = self.start + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 0):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (running or waiting) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work; may preempt. An empty list means nothing can run."""
        budget, out, preempted = self.max_num_batched_tokens, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            lookahead = min(self.lookahead, budget - n) if seq.is_decoding else 0
            while not self.bm.can_append(seq, n + lookahead):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it was the newest and got preempted itself
            self.bm.append_slots(seq, n + lookahead)
            out.append(ScheduledSeq(seq, n, lookahead))
            budget -= n + lookahead
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq):
                break
            self.waiting.popleft()
            self.bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out
