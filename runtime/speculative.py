"""Speculative decoding inside continuous batching: draft k tokens, verify them in one target forward.

Drafts come from prompt lookup (``NgramProposer``: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens) or from a smaller draft model sharing the tokenizer,
with its own KV pool addressed by the same block tables. The target scores ``[last token, d1..dk]``
in one forward (the decode group of the attention metadata); each sequence keeps its own accepted
prefix. Greedy requests accept drafts while they equal the target's argmax, so their output is
token-identical to plain decoding. Sampled requests use rejection sampling (Leviathan et al., 2023;
Chen et al., 2023): accept ``d`` with probability ``min(1, p(d) / q(d))``, else draw from
``norm(max(0, p - q))``, and draw a bonus token from ``p`` when all are accepted; the output is then
distributed exactly as the target's. A prompt-lookup draft is a point mass (``q(d) = 1``).
Rejected positions are rolled back: ``num_computed_tokens`` stops at the accepted prefix (their KV
slots are simply overwritten later) and blocks past it go back to the pool.
Under a grammar (runtime/guided.py) a draft model proposes from logits masked with the state its earlier
proposals reach, drafts are cut where the grammar stops taking them, and verify row ``i`` is masked with the
state after the first ``i`` drafts; every walk ahead is rolled back, so the matcher advances only by the
tokens accepted, and greedy output under a grammar is token-identical to plain decoding.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from runtime import guided
from runtime.block_manager import BlockManager
from runtime.model_runner import ForwardItem, ModelRunner
from runtime.sampler import Sampler
from runtime.scheduler import ScheduledSeq
from runtime.sequence import Sequence


class NgramProposer:
    """Prompt lookup: continue the latest earlier match of the longest suffix n-gram (n_max down to n_min)."""

    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        arr = np.asarray(tokens)
        last = len(arr) - 1
        ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier positions holding the last token
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            ok = ends[ends >= n - 1]
            for m in range(1, n):
                ok = ok[arr[ok - m] == arr[last - m]]
            if ok.size:
                j = int(ok[-1]) + 1
                return [int(t) for t in arr[j:j + k]]
        return []


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """Drafts up to the first disagreement with the target's argmax, then the target's own token."""
    out = []
    for i, d in enumerate(drafts):
        if target[i] != d:
            return out + [target[i]]
        out.append(d)
    return out + [target[len(drafts)]]


def accept_rejection(p: Tensor, drafts: list[int], q: Tensor | None, generator: torch.Generator) -> list[int]:
    """Rejection sampling of ``drafts`` against target probabilities ``p: [k+1, V]``; ``q: [k, V]`` or
    None for point-mass drafts. Returns the accepted drafts plus one token drawn from the target."""
    out = []
    for i, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[i, d])
        if float(torch.rand((), generator=generator)) * qd < float(p[i, d]):
            out.append(d)
            continue
        residual = p[i].clone() if q is None else (p[i] - q[i]).clamp_(min=0)
        if q is None:
            residual[d] = 0.0
        if float(residual.sum()) <= 0:  # only reachable through rounding
            residual = p[i]
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


class SpeculativeDecoder:
    """Executes scheduled batches with drafting + verification; counts drafted/accepted tokens."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, max_model_len: int,
                 proposer: NgramProposer | None = None, draft: ModelRunner | None = None):
        assert (proposer is None) != (draft is None), "exactly one of proposer / draft model"
        self.runner, self.sampler, self.max_model_len = runner, sampler, max_model_len
        self.proposer, self.draft = proposer, draft
        self.drafted = self.accepted = 0

    def _num_drafts(self, s: ScheduledSeq) -> int:
        seq, p = s.seq, s.seq.params
        room = min(p.max_tokens - seq.num_completion_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(s.lookahead, room)) if s.completes and not p.plain_only else 0

    def _draft_tokens(self, logits: Tensor, seqs: list[Sequence]) -> tuple[list[int], Tensor | None]:
        """One draft token per row, plus the draft distribution rows (None when all are greedy)."""
        if all(s.params.greedy for s in seqs):
            return logits.argmax(-1).tolist(), None
        probs = self.sampler.probs(logits, [s.params for s in seqs])
        return [self.sampler.sample_from(probs[i], s) for i, s in enumerate(seqs)], probs

    def _propose_with_model(self, batch: list[ScheduledSeq], want: dict[Sequence, int]):
        """Catch the draft's KV up to the target's, then run it k times on its own proposals."""
        drafts: dict[Sequence, list[int]] = {}
        dprobs: dict[Sequence, list[Tensor]] = {}
        items, asking = [], []
        for s in batch:
            seq, end = s.seq, s.start + s.num_new_tokens
            if seq.num_draft_computed < end:
                items.append(ForwardItem(seq.token_ids[seq.num_draft_computed:end], seq.num_draft_computed,
                                         seq.block_table, int(want[seq] > 0)))
                seq.num_draft_computed = end
                if want[seq] > 0:
                    asking.append(seq)
        logits = self.draft.forward(items) if items else None
        walk = guided.DraftWalk()
        while asking:
            walk.mask(logits, asking)
            tokens, probs = self._draft_tokens(logits, asking)
            for i, seq in enumerate(asking):
                drafts.setdefault(seq, []).append(tokens[i])
                dprobs.setdefault(seq, []).append(None if probs is None else probs[i])
                walk.take(seq, tokens[i])
            asking = [seq for seq in asking if len(drafts[seq]) < want[seq]]
            if asking:
                logits = self.draft.forward([ForwardItem([drafts[seq][-1]], seq.num_draft_computed, seq.block_table, 1)
                                             for seq in asking])
                for seq in asking:
                    seq.num_draft_computed += 1
        walk.undo()
        q = {seq: None if rows[0] is None else torch.stack(rows) for seq, rows in dprobs.items()}
        return drafts, q

    def _propose(self, batch: list[ScheduledSeq], want: dict[Sequence, int]):
        """Drafts per sequence and their draft distributions. Greedy and point-mass drafts are cut where a grammar
        stops taking them (no use verifying them); drafts sampled from a distribution are not, as rejection
        sampling stays exact only when it rejects them itself (the grammar's mask gives them p = 0)."""
        if self.draft is not None:
            drafts, q = self._propose_with_model(batch, want)
        else:
            drafts, q = {s.seq: self.proposer.propose(s.seq.token_ids, want[s.seq]) for s in batch if want[s.seq]}, {}
        for seq, d in drafts.items():
            if seq.params.greedy or q.get(seq) is None:
                drafts[seq] = d[:guided.accepted_drafts(seq, d)]
        return drafts, q

    def execute(self, batch: list[ScheduledSeq], bm: BlockManager) -> dict[Sequence, list[int]]:
        want = {s.seq: self._num_drafts(s) for s in batch}
        drafts, q = self._propose(batch, want)
        items = []
        for s in batch:
            d = drafts.get(s.seq, [])
            items.append(ForwardItem(s.seq.token_ids[s.start:s.start + s.num_new_tokens] + d, s.start,
                                     s.seq.block_table, 1 + len(d) if s.completes else 0))
        logits = self.runner.forward(items)
        out, row = {}, 0
        for s in batch:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            if not s.completes:
                continue
            d = drafts.get(seq, [])
            lg = logits[row:row + 1 + len(d)]
            row += 1 + len(d)
            self.sampler.process(lg, [seq] * (1 + len(d)), list(range(1 + len(d))), drafts=d)
            if seq.params.greedy:
                tokens = accept_greedy(lg.argmax(-1).tolist(), d)
            else:
                p = self.sampler.probs(lg, [seq.params] * (1 + len(d)))
                tokens = accept_rejection(p, d, q.get(seq), self.sampler.generator_for(seq))
            if not d:  # a plain_only request (penalties, logprobs) never has drafts
                self.sampler.record_logprobs(lg, [seq], tokens)
            self.drafted += len(d)
            self.accepted += len(tokens) - 1
            seq.num_computed_tokens += len(tokens) - 1  # the accepted drafts' KV stays
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
            bm.truncate(seq, seq.num_computed_tokens + 1)
            out[seq] = tokens
        return out
