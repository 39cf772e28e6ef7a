"""Token selection: greedy, temperature, top-k, top-p, min-p, per-request seeds; logit processing
(min_tokens masking, presence/frequency/repetition penalties, logit bias) and logprobs, per row."""
from __future__ import annotations

import torch
from torch import Tensor

from runtime import guided
from runtime.sequence import SamplingParams, Sequence, TokenLogprob

__all__ = ["Sampler", "SamplingParams", "token_logprobs"]
LOGPROB_FLOOR = -9999.0  # stands for -inf (a masked token), which JSON cannot carry


def token_logprobs(logprobs: Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """Each row's ``targets[i]`` log-probability and its top ``k`` alternatives (``logprobs: [rows, V]``)."""
    chosen = logprobs.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
    vals, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    vals = vals.clamp(min=LOGPROB_FLOOR)
    return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in zip(targets, chosen.tolist(), ids.tolist(), vals.tolist())]


class Sampler:
    """Turns logit rows into tokens; rows of one forward may belong to requests with different params."""

    def __init__(self, seed: int, eos_token_ids: tuple[int, ...] = ()):
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = eos_token_ids
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The request's own generator when it has a seed, else the engine's."""
        if seq.params.seed is None:
            return self.generator
        g = self._generators.get(seq.request_id)
        if g is None:
            g = self._generators[seq.request_id] = torch.Generator().manual_seed(seq.params.seed)
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def suppress_stops(self, logits: Tensor, seqs: list[Sequence], offsets: list[int]) -> None:
        """Mask EOS and stop tokens in row ``i`` while ``seqs[i]`` has fewer than min_tokens (in place).

        ``offsets[i]`` counts tokens that row ``i``'s token comes after, beyond the sequence's
        completion so far (0 for plain decoding, j for the j-th verified draft position).
        """
        for i, (seq, off) in enumerate(zip(seqs, offsets)):
            p = seq.params
            if p.min_tokens and seq.num_completion_tokens + off < p.min_tokens and p.guide is None:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

    def process(self, logits: Tensor, seqs: list[Sequence], offsets: list[int],
                drafts: list[int] | None = None) -> None:
        """Every per-request change to the logit rows before sampling (in place); ``offsets`` as in suppress_stops.
        ``drafts``: the rows are one sequence's verify rows, row ``i`` after ``drafts[:i]`` (speculative decoding)."""
        self.suppress_stops(logits, seqs, offsets)
        self.penalize(logits, seqs)
        for i, seq in enumerate(seqs):
            if seq.params.logit_bias:
                ids, bias = zip(*seq.params.logit_bias)
                logits[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype)
        if any(s.params.guide is not None for s in seqs):  # last: a grammar's mask overrides every bias
            if drafts is None:
                guided.apply(logits, seqs)
            else:
                guided.apply_to_drafts(logits, seqs[0], drafts)

    @staticmethod
    def penalize(logits: Tensor, seqs: list[Sequence]) -> None:
        """Presence/frequency penalties on generated tokens, repetition penalty on every token seen (in place), on
        the distinct ids each sequence holds: work grows with its length, never with the vocabulary."""
        for i, s in enumerate(seqs):
            p = s.params
            if not p.penalized:
                continue
            x = logits[i].float()  # a copy: every penalty lands in float32, then one cast back
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(s.token_ids, dtype=torch.long).unique()
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                ids, n = torch.tensor(s.completion_token_ids, dtype=torch.long).unique(return_counts=True)
                x[ids] -= p.frequency_penalty * n + p.presence_penalty
            logits[i] = x.to(logits.dtype)

    @staticmethod
    def record_logprobs(logits: Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Append each asking row's sampled token's logprob (processed logits at its temperature) to its sequence."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return
        temps = torch.tensor([seqs[i].params.temperature or 1.0 for i in rows])[:, None]
        lp = (logits[rows].float() / temps).log_softmax(-1)
        k = max(seqs[i].params.logprobs for i in rows)
        for i, entry in zip(rows, token_logprobs(lp, [tokens[i] for i in rows], k)):
            seqs[i].logprobs.append(entry._replace(top=entry.top[:seqs[i].params.logprobs]))

    @staticmethod
    def probs(logits: Tensor, params: list[SamplingParams]) -> Tensor:
        """The distribution each row samples from after temperature, top-k and top-p (greedy: one-hot)."""
        logits = logits.float()
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
        x = logits / temps[:, None]
        top_k = [p.top_k if p.top_k and not p.greedy else 0 for p in params]
        top_p = [p.top_p if not p.greedy else 1.0 for p in params]
        if any(top_k) or any(v < 1.0 for v in top_p):
            sorted_x, order = x.sort(dim=-1, descending=True)
            vocab = x.shape[1]
            k = torch.tensor([v if v else vocab for v in top_k])
            rank = torch.arange(vocab)[None, :]
            sorted_x = sorted_x.masked_fill(rank >= k[:, None], float("-inf"))
            sp = sorted_x.softmax(-1)
            # drop tokens once the mass before them already reaches top_p (the first always stays)
            before = sp.cumsum(-1) - sp
            sorted_x = sorted_x.masked_fill(before >= torch.tensor(top_p)[:, None], float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
        out = x.softmax(-1)
        min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params])[:, None]
        if bool((min_p > 0).any()):
            out = out.masked_fill(out < min_p * out.max(-1, keepdim=True).values, 0.0)
            out = out / out.sum(-1, keepdim=True)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            rows = torch.tensor(greedy)
            out[rows] = 0.0
            out[rows, logits[rows].argmax(-1)] = 1.0
        return out

    def sample_from(self, probs: Tensor, seq: Sequence) -> int:
        """One token from a probability row with the request's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator_for(seq)))

    def sample(self, logits: Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row: argmax for greedy requests, a draw from ``probs`` for the others."""
        tokens = logits.argmax(-1).tolist()
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = self.probs(logits[sampled], [seqs[i].params for i in sampled])
            for row, i in enumerate(sampled):
                tokens[i] = self.sample_from(probs[row], seqs[i])
        return tokens
