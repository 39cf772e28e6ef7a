"""Engine configuration: one frozen dataclass, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.kernels.kv_quant import KV_CACHE_DTYPES, kv_format

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANT_KERNELS = ("auto", "hybrid", "packed", "dequant")
LM_HEADS = ("auto", "fp", "int8", "int4")  # runtime/kernels/lm_head.py LM_HEAD_SCHEMES has the last two
MODEL_IMPLS = ("auto", "native", "transformers")  # runtime/models/dispatch.py


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the requests.

    ``model``/``draft`` are model specs for ``compress.format.models.resolve`` (a name such as
    ``"smollm2-135m"``, an HF folder, a .gguf file, or a folder written by ``compress quantize``).
    ``draft="ngram"`` turns on prompt-lookup speculation (no second model).
    ``num_kv_blocks=None`` sizes the paged KV pool from ``kv_cache_memory`` bytes, an upper bound: on CPU the pool's
    memory is committed as blocks are first written (runtime/model_runner.py ``zeros_on_demand``), so startup
    costs none of it and the resident KV grows with what the workload holds (prefix-cached blocks included).
    ``max_model_len=None`` takes the model's context length, capped by the KV pool.
    ``quant_kernel`` picks the matmul for quantized linears (runtime/kernels/qmatmul.py): ``"packed"``
    runs the packed integer kernels straight from the integers (bf16 activations inside, so
    results carry bf16 rounding; formats without a kernel fall back to dequantized weights); ``"auto"``
    does the same, and for calls of many rows (prefill, batched decoding) where a bf16 GEMM is faster (AMX)
    dequantizes each weight into one shared scratch buffer per call, keeping no copy (aten's int4pack/int8pack,
    without the VNNI kernels, still keep one); ``"hybrid"`` keeps a persistent bf16 copy of every packed weight
    for those calls (2 bytes a weight more: prompt throughput on AMX at that memory); ``"dequant"`` dequantizes each
    weight once to ``dtype`` (bit-for-bit what ``QuantLinear.forward`` computes, at fp memory and speed).
    ``dtype="auto"`` follows the checkpoint's own dtype (``dtype``/``torch_dtype`` in its config; runtime/cpu.py):
    float32 stays float32, bfloat16 and float16 checkpoints run bf16 (auto never picks float16), quantized ones bf16
    for their packed kernels; on a CPU without native bf16, float32. An explicit ``"float16"`` that overflows on
    the model is refused at load with the fix (runtime/overflow.py).
    ``lm_head`` on CPU: ``"fp"`` keeps the model's head, ``"int8"`` (per channel) / ``"int4"`` (group 32) round it to
    nearest at load; ``"auto"`` is int8 for a quantized checkpoint computed in bf16 (as llama.cpp stores
    SmolLM2's head in Q8_0), else fp. A head that ``compress quantize`` quantized keeps its own format.
    ``fused_cpu_kernels`` runs the small per-layer ops and decode attention in one fused kernel each
    (runtime/kernels/cpu/fused_ops.cpp, built once per machine); False keeps the torch reference ops.
    ``native_decode_step`` runs the decode rows of a model whose layers all fit its form (pre norms, W8A8 linears,
    a KV cache in the compute dtype: runtime/kernels/native_step.py) in one native call per step; False, or a model
    it refuses, keeps one call per op.
    ``huge_pages`` holds the packed W8A8 weights on CPU in transparent huge pages where Linux offers them
    (runtime/hugepages.py): the same bytes, streamed faster at batch-1 decode; False leaves them where they were made.
    ``kv_cache_dtype``: ``"auto"`` stores K and V in the compute dtype; ``"int8"`` / ``"fp8_e4m3"`` (where this
    torch has ``float8_e4m3fn``) store 8-bit codes with an fp16 scale per token and KV head, about twice the
    tokens in the same ``kv_cache_memory`` as a 16-bit cache (runtime/kernels/kv_quant.py).
    ``model_impl``: ``"auto"`` serves a family with a native runtime model natively (the fast path) and any other
    decoder through transformers' own modeling code with the engine's paged KV cache (slower);
    ``"native"``/``"transformers"`` force one (runtime/models/dispatch.py). ``trust_remote_code`` lets a checkpoint's
    own Python code (``auto_map``) run; without it such a model is refused.
    Prompt lookup matches suffix n-grams of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens
    (on free-running text ``prompt_lookup_min=2`` wastes fewer verifications on CPU; 1 drafts more often).
    """

    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    draft: str | None = None
    num_speculative_tokens: int = 4
    enable_prefix_caching: bool = True
    seed: int = 0
    quant_kernel: str = "auto"
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    lm_head: str = "auto"
    fused_cpu_kernels: bool = True
    native_decode_step: bool = True
    huge_pages: bool = True
    kv_cache_dtype: str = "auto"
    model_impl: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is empty; give a model name or folder")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size={self.block_size} is out of range; use 1..1024 (16 is typical)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1, "
                             "or None to size it from kv_cache_memory")
        if self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} bytes must be positive")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2, or None for the model's own")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {DTYPES}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not supported; use 'cpu' or 'cuda[:N]'")
        if self.draft is not None and not self.draft:
            raise ValueError("draft='' is empty; use None (no speculation), 'ngram', or a draft model spec")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} is out of range; use 1..16")
        if self.quant_kernel not in QUANT_KERNELS:
            raise ValueError(f"quant_kernel={self.quant_kernel!r} is unknown; use one of {QUANT_KERNELS}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head={self.lm_head!r} is unknown; use one of {LM_HEADS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is unknown; use one of {KV_CACHE_DTYPES}")
        kv_format(self.kv_cache_dtype)  # fp8 without torch support: a clear error here, not at the first write
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl={self.model_impl!r} is unknown; use one of {MODEL_IMPLS}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}: "
                             "need 1 <= min <= max")

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    @property
    def lookahead(self) -> int:
        """KV slots reserved past the last token of a decoding sequence (the drafted tokens)."""
        return self.num_speculative_tokens if self.speculative else 0
