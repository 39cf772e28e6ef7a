"""Builds a forward's tensors from the scheduled work, owns the model and its paged KV pool, returns logits.

The runner knows nothing of requests: it is handed ``ForwardItem``s (tokens to feed at consecutive
positions after ``start`` cached ones, the block table, how many trailing positions need logits) and
returns those logits. Items with at most ``decode_q_len`` tokens form the batched decode group of the
attention metadata; longer ones the per-sequence prefill group (see runtime/kernels/attention.py).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.format.host import trim
from runtime import hugepages
from runtime.kernels import lm_head as heads
from runtime.kernels import native_step as native
from runtime.kernels import qmatmul
from runtime.kernels.attention import AttentionMetadata, fused_paged_attention, triton_paged_attention
from runtime.kernels.fused import FUSED_CPU_OPS, select_ops
from runtime.kernels.kv_quant import SCALE_DTYPE, kv_bytes_per_token_head, kv_format
from runtime.kernels.moe import prepare_experts
from runtime.kernels.prepare import prepare_model
from runtime.models.dispatch import RuntimeConfig, build_model
from runtime.models.loader import Checkpoint
from runtime.overflow import check_finite, probe_tokens

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardItem:
    """One sequence's share of a forward."""

    token_ids: list[int]  # fed at positions start .. start + len - 1
    start: int  # tokens of this sequence already in the KV cache
    block_table: list[int]
    num_logits: int  # how many trailing positions' logits to return (0 .. len)


def kv_bytes_per_block(cfg: RuntimeConfig, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V for one block across all layers, 8-bit codes' scales included."""
    per_head = kv_bytes_per_token_head(cfg.head_dim, DTYPES[dtype], kv_format(kv_cache_dtype))
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_head


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros whose memory the OS commits page by page on first write (an anonymous private map, zero-filled by
    the kernel) on CPU: a KV pool sized for the worst case costs resident memory only for the blocks a workload
    has written, not ``kv_cache_memory`` at startup. Elsewhere (CUDA, no ``mmap``), plain ``torch.zeros``."""
    import math

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or not nbytes:
        return torch.zeros(shape, dtype=dtype, device=device)
    return hugepages.arena(nbytes, huge=False).view(dtype).view(shape)  # the tensor keeps the mapping alive


class ModelRunner:
    """One model (target or draft) with its own KV pool of ``num_blocks`` blocks."""

    def __init__(self, ckpt: Checkpoint, num_blocks: int, block_size: int, dtype: str, device: str,
                 quant_kernel: str, max_positions: int, decode_q_len: int = 1, fused_cpu: bool = True,
                 lm_head: str = "fp", kv_cache_dtype: str = "auto", model_impl: str = "auto",
                 trust_remote_code: bool = False, native_step: bool = True, huge_pages: bool = True):
        self.dtype, self.device = DTYPES[dtype], torch.device(device)
        self.block_size, self.num_blocks, self.decode_q_len = block_size, num_blocks, decode_q_len
        self.model = build_model(ckpt, self.dtype, max_positions, model_impl, trust_remote_code)
        self.config = self.model.config
        self.ops = select_ops(self.device.type, self.dtype, fused_cpu)
        fused = self.ops is FUSED_CPU_OPS
        # a model too large for copies of its weights runs from its packed codes, its fp head as it is
        lean = (self.device.type == "cpu" and quant_kernel in ("auto", "hybrid")
                and qmatmul.too_large_for_copies(self.model, quant_kernel, fused))
        lm_head = "fp" if lean and lm_head == "auto" else lm_head
        self.kernel_paths = prepare_model(self.model, quant_kernel, self.dtype, self.device.type, fused, lean)
        self.kernel_paths.update(prepare_experts(self.model, quant_kernel, self.device.type))
        self.lm_head_kind = self._prepare_head(lm_head, ckpt.quantized, fused, lean, quant_kernel)
        trim()  # the conversions' temporaries back to the OS before the KV pool is allocated
        self.num_prepacked = 0
        if self.device.type == "cpu" and not lean:
            self.num_prepacked = qmatmul.pack_dense_linears(self.model, self.dtype, fused)
        if self.device.type == "cpu" and huge_pages and (moved := hugepages.move_weights(self.model)):
            trim()  # the 4 KiB-page buffers they left
            log.info("packed weights in transparent huge pages: %.1f MiB", moved / 2**20)
        self.model.to(self.device)
        self._allocate_kv(kv_cache_dtype)
        self.model.set_ops(self.ops)
        for i, attn in enumerate(self.model.attention_modules()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            if self.kv_scales is not None:
                attn.k_scale, attn.v_scale = self.kv_scales[0, i], self.kv_scales[1, i]
            if self.device.type == "cuda":
                attn.attn_fn = triton_paged_attention
            elif fused:
                attn.attn_fn = fused_paged_attention
        log.info("small ops and decode attention: %s", self.ops.name)
        if hasattr(self.model, "native_step"):  # the native decoder (runtime/models/llama.py) hosts one
            self.model.native_step = native.build(self.model, self.ops, self.device.type, native_step)
        if self.dtype == torch.float16:
            self._probe_float16(ckpt.config.get("bos_token_id"))

    def _probe_float16(self, bos_token_id: int | None) -> None:
        """One short forward at load that refuses float16 where the model overflows it (runtime/overflow.py); the
        blocks it wrote are zeroed again."""
        ids = probe_tokens(self.vocab_size, bos_token_id)[:self.num_blocks * self.block_size]
        blocks = -(-len(ids) // self.block_size)
        self.forward([ForwardItem(ids, 0, list(range(blocks)), len(ids))])  # raises Float16Overflow
        self.kv_cache[:, :, :blocks].zero_()
        if self.kv_scales is not None:
            self.kv_scales[:, :, :blocks].zero_()

    def _allocate_kv(self, kv_cache_dtype: str) -> None:
        """The paged pool ``[2, layers, blocks, block_size, Hkv, D]`` in the compute dtype, or 8-bit codes with
        a parallel fp16 scale pool ``[2, layers, blocks, block_size, Hkv]`` (runtime/kernels/kv_quant.py); on CPU
        committed as blocks are first written (:func:`zeros_on_demand`)."""
        cfg, fmt = self.config, kv_format(kv_cache_dtype)
        shape = (2, cfg.num_layers, self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = zeros_on_demand(shape, self.dtype if fmt is None else fmt.storage, self.device)
        self.kv_scales = None if fmt is None else zeros_on_demand(shape[:-1], SCALE_DTYPE, self.device)

    def _prepare_head(self, choice: str, quantized: bool, fused: bool, lean: bool = False,
                      quant_kernel: str = "auto") -> str:
        """Quantize or prepack an fp LM head on CPU (EngineConfig's ``lm_head``); returns what runs it."""
        model, head = self.model, self.model.lm_head
        if head is not None and type(head) is not nn.Linear:  # quantized by compress quantize: its own kernel
            return "checkpoint"
        if self.device.type != "cpu":
            return "fp"
        choice = heads.resolve_lm_head(choice, quantized, self.dtype, self.device.type)
        if lean and choice == "fp":  # a prepacked copy would hold the head twice while it is made
            return choice
        weight = model.embed_tokens.weight if head is None else head.weight
        module = heads.prepare_lm_head(weight, choice, self.dtype, fused, lean, quant_kernel)
        if module is not None:
            model.lm_head = module
        return choice

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _tables(self, items: list[ForwardItem]) -> Tensor:
        width = max((len(it.block_table) for it in items), default=0)
        return torch.tensor([it.block_table + [0] * (width - len(it.block_table)) for it in items],
                            dtype=torch.int32).reshape(len(items), width)

    def prepare(self, items: list[ForwardItem]) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """(input_ids, positions, metadata, logit rows in item order) with prefill items first."""
        pre = [i for i, it in enumerate(items) if len(it.token_ids) > self.decode_q_len]
        dec = [i for i, it in enumerate(items) if len(it.token_ids) <= self.decode_q_len]
        bs = self.block_size
        ids, pos, slots, row_of = [], [], [], {}
        for i in pre + dec:
            it = items[i]
            n, base = len(it.token_ids), len(ids)
            row_of[i] = range(base + n - it.num_logits, base + n)
            ids += it.token_ids
            positions = range(it.start, it.start + n)
            pos += positions
            table = it.block_table
            slots += [table[p // bs] * bs + p % bs for p in positions]
        rows = [r for i in range(len(items)) for r in row_of[i]]
        q_pre = [len(items[i].token_ids) for i in pre]
        q_dec = [len(items[i].token_ids) for i in dec]
        seq_dec = [items[i].start + len(items[i].token_ids) for i in dec]
        dev = self.device

        def cu(lens: list[int]) -> Tensor:
            return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=dev)

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_prefill_tokens=sum(q_pre),
            prefill_cu_seqlens_q=cu(q_pre),
            prefill_seq_lens=torch.tensor([items[i].start + len(items[i].token_ids) for i in pre], dtype=torch.int32,
                                          device=dev),
            prefill_block_tables=self._tables([items[i] for i in pre]).to(dev),
            prefill_q_lens=q_pre, prefill_ctx_lens=[items[i].start for i in pre],
            decode_q_lens=q_dec, decode_cu_seqlens_q=cu(q_dec),
            decode_seq_lens=torch.tensor(seq_dec, dtype=torch.int32, device=dev),
            decode_block_tables=self._tables([items[i] for i in dec]).to(dev),
            max_decode_seq_len=max(seq_dec, default=0),
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(rows, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> Tensor:
        """Run the model on ``items``; fp32 logits ``[sum(num_logits), vocab]`` in item order (CPU). In float16 they
        are checked for inf/NaN (runtime/overflow.py)."""
        input_ids, positions, meta, rows = self.prepare(items)
        hidden = self.model(input_ids, positions, meta)
        if rows.numel() == 0:
            return torch.empty(0, self.vocab_size)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).cpu()
        check_finite(logits, self.dtype)
        return logits
