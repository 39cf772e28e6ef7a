"""Offline generation, as vLLM's ``LLM`` offers it: the serving engine without the HTTP server.

    from runtime import LLM, SamplingParams
    llm = LLM("out/smollm2-135m-awq4", kv_cache_memory=1 << 28)
    for c in llm.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(c.text)

Keyword options are runtime/config.py ``EngineConfig`` fields (``dtype``, ``kv_cache_dtype``, ``draft``, ...).
"""
from __future__ import annotations

from runtime.config import EngineConfig
from runtime.engine import Completion, Engine
from runtime.sequence import SamplingParams


class LLM:
    """One model loaded into the engine; ``generate`` runs prompts to completion with continuous batching."""

    def __init__(self, model: str, **options):
        self.engine = Engine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Completions in prompt order (greedy, 64 new tokens, unless ``sampling`` says otherwise)."""
        return self.engine.generate(prompts, sampling)
