"""The serving engine: requests in, tokens out, one ``step()`` (schedule, forward, sample, stop) at a time.

Thread-safety: ``add_request``/``abort`` may be called from any thread; they only validate and push
onto an inbox that ``step()`` drains at its start, so a thread looping ``step()`` never races them.
``stats()`` and ``has_unfinished()`` may also be called from any thread.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from runtime import detokenizer
from runtime.block_manager import BlockManager
from runtime.config import EngineConfig
from runtime.cpu import resolve_dtype
from runtime.model_runner import ForwardItem, ModelRunner, kv_bytes_per_block
from runtime.models.dispatch import RuntimeConfig, model_config
from runtime.models.loader import open_checkpoint
from runtime.sampler import Sampler, token_logprobs
from runtime.scheduler import ScheduledSeq, Scheduler
from runtime.sequence import SamplingParams, Sequence, SequenceStatus, TokenLogprob
from runtime.speculative import NgramProposer, SpeculativeDecoder

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one request gained in one step."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    prompt_tokens: int
    completion_tokens: int
    first_token_time: float | None
    arrival_time: float
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # in the request's first output, when it asked


@dataclass
class Completion:
    """A finished request (offline API)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = c = config
        if c.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={c.device!r} but this torch sees no CUDA device; use device='cpu'")
        ckpt = open_checkpoint(c.model, c.trust_remote_code)
        self.tokenizer, self.eos_token_ids = ckpt.tokenizer, ckpt.eos_token_ids
        mcfg = model_config(ckpt, c.model_impl, c.trust_remote_code)
        dckpt = open_checkpoint(c.draft, c.trust_remote_code) if c.draft not in (None, "ngram") else None
        dcfg = model_config(dckpt, c.model_impl, c.trust_remote_code) if dckpt else None
        if dcfg and dcfg.vocab_size != mcfg.vocab_size:
            raise ValueError(f"draft {c.draft!r} has vocab_size={dcfg.vocab_size}, the model {mcfg.vocab_size}; "
                             "the draft must share the model's tokenizer")
        choice = resolve_dtype(c.dtype, "cpu" if c.device == "cpu" else "cuda", ckpt.stored_dtype, ckpt.quantized)
        self.dtype = choice.dtype
        log.info("engine dtype: %s (%s)", choice.dtype, choice.reason)
        per_block = sum(kv_bytes_per_block(m, c.block_size, self.dtype, c.kv_cache_dtype) for m in (mcfg, dcfg) if m)
        num_blocks = c.num_kv_blocks or c.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds no KV block "
                             f"({per_block} bytes each); raise it")
        self.max_model_len = self._max_model_len(mcfg, dcfg, num_blocks)

        def runner(ck):
            return ModelRunner(ck, num_blocks, c.block_size, self.dtype, c.device, c.quant_kernel,
                               self.max_model_len + c.lookahead + 1, decode_q_len=1 + c.lookahead,
                               fused_cpu=c.fused_cpu_kernels, lm_head=c.lm_head, kv_cache_dtype=c.kv_cache_dtype,
                               model_impl=c.model_impl, trust_remote_code=c.trust_remote_code,
                               native_step=c.native_decode_step, huge_pages=c.huge_pages)

        self.runner = runner(ckpt)
        draft_runner = runner(dckpt) if dckpt else None
        del ckpt, dckpt  # the runners hold their own copies of the weights
        self.block_manager = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens, c.lookahead)
        self.sampler = Sampler(c.seed, self.eos_token_ids)
        self.speculator = None
        if c.speculative:
            proposer = NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max) if c.draft == "ngram" else None
            self.speculator = SpeculativeDecoder(self.runner, self.sampler, self.max_model_len, proposer, draft_runner)
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()  # guards the scheduler state against stats()/add_request readers
        self._tok_lock = threading.Lock()  # a HF tokenizer must not encode and decode in two threads at once
        self._live: dict[str, Sequence] = {}
        self._forks: dict[Sequence, list[Sequence]] = {}  # choices waiting for their first choice's prompt KV
        self._ids = itertools.count()
        self.num_steps = self.prompt_tokens_total = self.generation_tokens_total = 0
        log.info("engine: %d KV blocks of %d tokens (%s), max_model_len=%d, quantized linears: %s, lm_head: %s",
                 num_blocks, c.block_size, c.kv_cache_dtype, self.max_model_len, self.runner.kernel_paths or "none",
                 self.runner.lm_head_kind)

    def _max_model_len(self, mcfg: RuntimeConfig, dcfg: RuntimeConfig | None, num_blocks: int) -> int:
        c = self.config
        models = [m for m in (mcfg, dcfg) if m]
        model_max = min(m.max_position_embeddings for m in models)
        capacity = num_blocks * c.block_size - c.lookahead
        if c.max_model_len is None:
            if capacity < 2:
                raise ValueError(f"the KV pool ({num_blocks} blocks of {c.block_size}) is too small; "
                                 "raise kv_cache_memory")
            return min(model_max, capacity)
        if c.max_model_len > model_max:
            raise ValueError(f"max_model_len={c.max_model_len} exceeds the model's context of {model_max} tokens; "
                             "lower it")
        if c.max_model_len > capacity:
            raise ValueError(f"max_model_len={c.max_model_len} does not fit the KV pool ({num_blocks} blocks of "
                             f"{c.block_size} tokens); raise kv_cache_memory/num_kv_blocks or lower max_model_len")
        return c.max_model_len

    # --- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model!r} has no tokenizer; pass token ids instead of text")
        with self._tok_lock:
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))

    def token_strings(self, ids) -> dict[int, str]:
        """Each distinct token id's own text (logprobs name tokens by it)."""
        uniq = sorted(set(ids))
        if self.tokenizer is None:
            return {t: str(t) for t in uniq}
        with self._tok_lock:
            return dict(zip(uniq, self.tokenizer.batch_decode([[t] for t in uniq])))

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError for an empty or too long prompt."""
        return self.add_choices(prompt, [params or SamplingParams()], [request_id])[0]

    def add_choices(self, prompt: str | list[int], params: list[SamplingParams], request_ids: list) -> list[str]:
        """Queue several choices of one prompt (OpenAI's ``n``). The first prefills the prompt; the others wait
        until its full blocks are in the prefix cache and share them (ref counts) instead of recomputing them."""
        ids = self._prompt_ids(prompt)
        with self._lock:
            seqs = [self._new_seq(ids, p, rid) for p, rid in zip(params, request_ids)]
            self._inbox.append(("add", seqs[0]))
            if len(seqs) > 1:
                self._forks[seqs[0]] = seqs[1:]
        return [seq.request_id for seq in seqs]

    def _new_seq(self, ids: list[int], params: SamplingParams, request_id: str | None) -> Sequence:
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self._live:
            raise ValueError(f"request_id={request_id!r} is already in use; pick another")
        seq = Sequence(request_id, list(ids), params, arrival_time=time.time())
        detokenizer.init_offsets(seq)
        self._live[request_id] = seq
        return seq

    def _release_forks(self) -> None:
        """Queue the waiting choices whose first choice has its prompt's KV computed (or is gone)."""
        for first, rest in list(self._forks.items()):
            if first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens:
                del self._forks[first]
                self._inbox.extend(("add", seq) for seq in rest)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.runner.vocab_size
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}; "
                             "shorten it or raise max_model_len (and kv_cache_memory)")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the start of the next step, which reports it."""
        self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._forks) or self.scheduler.has_unfinished()

    # --- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one iteration of continuous batching; returns what each touched request gained."""
        with self._lock:
            self._release_forks()
            outputs = self._drain_inbox()
            batch = self.scheduler.schedule()
        if not batch:
            return outputs
        with torch.inference_mode():
            if self.speculator is not None and not any(self._scores_prompt(s) for s in batch):
                new_tokens = self.speculator.execute(batch, self.block_manager)
            else:
                new_tokens = self._execute(batch)
        with self._lock:
            outputs += self._postprocess(batch, new_tokens)
            self.num_steps += 1
        return outputs

    def _drain_inbox(self) -> list[StepOutput]:
        outputs = []
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                if item.status is SequenceStatus.WAITING:  # not aborted while queued
                    self.scheduler.add(item)
                    self.prompt_tokens_total += item.num_prompt_tokens
            elif (seq := self._live.get(item)) is not None:
                in_scheduler = seq in self.scheduler.running or seq in self.scheduler.waiting
                if in_scheduler:
                    self.scheduler.finish(seq, "abort")
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                outputs.append(self._retire(seq))
        return outputs

    @staticmethod
    def _scores_prompt(s: ScheduledSeq) -> bool:
        """``s``'s chunk predicts prompt tokens whose logprobs the request asked for."""
        return s.seq.params.prompt_logprobs is not None and s.start < s.seq.num_prompt_tokens - 1

    def _num_logits(self, s: ScheduledSeq) -> int:
        """Logit rows the forward returns for ``s``: every position of a prompt chunk that is scored."""
        return s.num_new_tokens if self._scores_prompt(s) else int(s.completes)

    @staticmethod
    def _record_prompt_logprobs(s: ScheduledSeq, logits: Tensor) -> None:
        """Log-probabilities of the prompt tokens this chunk predicts (``logits``: one row per chunk position)."""
        seq = s.seq
        positions = range(max(len(seq.prompt_logprobs), s.start), min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1))
        if len(positions):
            lp = logits[[p - s.start for p in positions]].float().log_softmax(-1)
            targets = [seq.token_ids[p + 1] for p in positions]
            seq.prompt_logprobs += token_logprobs(lp, targets, seq.params.prompt_logprobs)

    def _execute(self, batch: list[ScheduledSeq]) -> dict[Sequence, list[int]]:
        """Plain decoding: one forward, one token for each sequence whose chunk reached its end."""
        items = [ForwardItem(s.seq.token_ids[s.start:s.start + s.num_new_tokens], s.start, s.seq.block_table,
                             self._num_logits(s)) for s in batch]
        logits = self.runner.forward(items)
        rows, end = [], 0
        for s, item in zip(batch, items):
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            if self._scores_prompt(s):
                self._record_prompt_logprobs(s, logits[end:end + item.num_logits])
            end += item.num_logits
            if s.completes:
                rows.append(end - 1)
        done = [s.seq for s in batch if s.completes]
        logits = logits[rows] if len(rows) < end else logits
        self.sampler.process(logits, done, [0] * len(done))
        tokens = self.sampler.sample(logits, done)
        self.sampler.record_logprobs(logits, done, tokens)
        return dict(zip(done, ([t] for t in tokens)))

    def _postprocess(self, batch: list[ScheduledSeq], new_tokens: dict[Sequence, list[int]]) -> list[StepOutput]:
        outputs, now = [], time.time()
        for s in batch:
            seq, tokens = s.seq, new_tokens.get(s.seq, [])
            reason = None
            for tok in tokens:
                reason = self._append(seq, tok, now)
                if reason:
                    break
            computed = seq.num_computed_tokens
            if self.speculator is not None and self.speculator.draft is not None:
                computed = min(computed, seq.num_draft_computed)
            self.block_manager.commit(seq, computed)
            if reason:
                self.scheduler.finish(seq, reason)
                outputs.append(self._retire(seq))
            elif tokens:
                outputs.append(self._output(seq, finished=False))
        return outputs

    def _append(self, seq: Sequence, tok: int, now: float) -> str | None:
        """Add one sampled token; returns the finish reason it causes, if any."""
        seq.token_ids.append(tok)
        if seq.guide_state is not None:
            seq.guide_state.advance(tok)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        p, n = seq.params, seq.num_completion_tokens
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            if n > p.min_tokens:
                return "stop"
        if self.tokenizer is not None:
            with self._tok_lock:
                new = detokenizer.decode_new_text(self.tokenizer, seq)
            seq.output_text += new
            cut = detokenizer.find_stop(seq.output_text, len(new), p.stop) if n >= p.min_tokens else None
            if cut is not None:
                seq.output_text = seq.output_text[:cut]
                return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, finished: bool) -> StepOutput:
        first, p = seq.num_emitted_tokens, seq.params
        new = seq.completion_token_ids[first:]
        seq.num_emitted_tokens = seq.num_completion_tokens
        logprobs = seq.logprobs[first:seq.num_emitted_tokens] if p.logprobs is not None else None
        prompt_logprobs = seq.prompt_logprobs if p.prompt_logprobs is not None and first == 0 else None
        return StepOutput(seq.request_id, new, detokenizer.pending_text(seq, finished), finished, seq.finish_reason,
                          seq.num_prompt_tokens, seq.num_completion_tokens, seq.first_token_time, seq.arrival_time,
                          logprobs, prompt_logprobs)

    def _retire(self, seq: Sequence) -> StepOutput:
        seq.finish_time = time.time()
        self._live.pop(seq.request_id, None)
        self.sampler.release(seq.request_id)
        seq.guide_state = None  # the grammar matcher goes with the request
        return self._output(seq, finished=True)

    # --- offline API --------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts (strings or token-id lists) to completion; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        acc = {rid: ([], []) for rid in ids}
        done: dict[str, Completion] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in acc:
                    continue
                toks, text = acc[out.request_id]
                toks += out.new_token_ids
                text.append(out.text_delta)
                if out.finished:
                    done[out.request_id] = Completion(out.request_id, "".join(text), toks, out.finish_reason,
                                                      out.prompt_tokens, out.completion_tokens, out.arrival_time,
                                                      out.first_token_time, time.time())
        return [done[rid] for rid in ids]

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StepOutput]:
        """Yield one request's outputs as they come, driving the engine (single-threaded use only)."""
        rid = self.add_request(prompt, params)
        finished = False
        while not finished:
            for out in self.step():
                if out.request_id == rid:
                    finished = out.finished
                    yield out

    def stats(self) -> dict:
        """Gauges and counters for metrics: queue sizes, KV usage, speculation, totals."""
        with self._lock:
            bm, sched = self.block_manager, self.scheduler
            fill: dict[int, int] = {}  # slots assigned to a token of a running sequence (KV computed or not yet)
            for seq in sched.running:
                for j, bid in enumerate(seq.block_table):
                    used = min(bm.block_size, max(0, seq.num_tokens - j * bm.block_size))
                    fill[bid] = max(fill.get(bid, 0), used)
            spec = self.speculator
            return {
                "running": len(sched.running),
                "waiting": len(sched.waiting) + len(self._inbox) + sum(map(len, self._forks.values())),
                "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks, "block_size": bm.block_size,
                "token_slots_allocated": bm.num_used_blocks * bm.block_size,
                "token_slots_used": sum(fill.values()),
                "prefix_cache_hit_tokens": bm.hit_tokens, "prefix_cache_queried_tokens": bm.queried_tokens,
                "spec_drafted": spec.drafted if spec else 0, "spec_accepted": spec.accepted if spec else 0,
                "num_preemptions": sched.num_preemptions, "num_steps": self.num_steps,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "max_model_len": self.max_model_len,
            }
