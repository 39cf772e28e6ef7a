"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, and min_tokens masking."""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.sequence import SamplingParams, Sequence

__all__ = ["Sampler", "SamplingParams"]


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
            if p.min_tokens and seq.num_completion_tokens + off < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

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
