"""The runtime's native decoder: the Llama family (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3,
olmo2, granite) and its mixture-of-experts relatives (mixtral, qwen2_moe, qwen3_moe, olmoe).

The families differ only in data: the family's entry in compress/format/families.py (keyed by ``config.model_type``)
and the values its config holds (runtime/models/model_config.py). Which norms surround attention and the MLP
(pre, Gemma 2/3's sandwich, OLMo 2's post) is runtime/models/blocks.py's ``NORM_ROLES``; Qwen3 and Gemma 3
normalize q and k per head before RoPE, OLMoE and OLMo 2 over the whole q and k projections (OLMoE may clip
q/k/v to ``clip_qkv``); Gemma stores RMSNorm weights as ``w - 1`` and scales embeddings by sqrt(hidden) (rounded
to the model dtype, as transformers does); Gemma 2 soft-caps attention scores and logits and, like Gemma 3,
scales q.k by ``query_pre_attn_scalar`` and alternates sliding-window and global layers (``layer_types``);
Gemma 3 rotates its sliding layers with their own rope parameters (one ``Rotary`` per layer type); Phi-3
rotates only the first ``partial_rotary_factor`` of each head and stores q/k/v and gate/up fused; Granite
multiplies embeddings, branch outputs and the q.k scale by its multipliers and divides logits by
``logits_scaling``. MoE families replace the MLP of their sparse layers by runtime/models/moe.py's
``SparseMoE``. Biases follow the checkpoint (Qwen2's q/k/v biases are simply present there).

The forward takes token ids, positions and the attention metadata explicitly: ``model(input_ids, positions,
meta)`` returns final hidden states ``[T, hidden]``; ``compute_logits`` runs the LM head on the rows that need
it. Linears are attributes the loader fills (fused ``qkv_proj`` and ``gate_up_proj``; each an ``nn.Linear``,
a quantized module, or a ``ConcatLinear``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.kernels.attention import AttentionMetadata
from runtime.kernels.fused import Ops
from runtime.models.blocks import Attention, AttentionFn, DecoderLayer
from runtime.models.layers import RMSNorm, Rotary
from runtime.models.model_config import ModelConfig
from runtime.models.moe import SparseMoE

__all__ = ["AttentionFn", "DecoderLM", "ModelConfig"]


class DecoderLM(nn.Module):
    """Token ids + positions + attention metadata -> hidden states; ``compute_logits`` for the LM head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        # on meta: the loader puts the checkpoint's table (or a QuantEmbedding) in its place, so no [vocab, hidden]
        # table is allocated and initialized only to be thrown away (272 MiB of startup peak on a 152k vocabulary);
        # given as ``_weight``, not initialized: a random init on meta imports torch's Python meta kernels (145 MiB)
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, dtype=dtype, device="meta"), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_offset, dtype)
        self.rotary = nn.ModuleDict({key: Rotary(cfg.head_dim, p["rope_theta"], p, max_positions)
                                     for key, p in cfg.rope.items()})
        self.rope_keys = [cfg.rope_key(i) for i in range(cfg.num_layers)]
        self.lm_head: nn.Module | None = None  # None: tied to embed_tokens
        # each layer ends with the next one's input norm (fused with the residual add), the last with the final norm
        self.next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self.native_step = None  # the runner's NativeStep (runtime/kernels/native_step.py), where the model fits it
        if cfg.arch.embed_scale:  # Gemma: sqrt(hidden) rounded to the model dtype first, as transformers does
            self.embed_scale: float | None = float(torch.tensor(cfg.hidden_size ** 0.5).to(dtype))
        else:
            self.embed_scale = cfg.embedding_multiplier  # Granite's, or None

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.native_step is not None and meta.num_prefill_tokens == 0 and meta.max_decode_q_len == 1:
            return self.native_step.run(x, positions, meta)  # decode rows only: every layer in one native call
        tables = {key: rotary(positions, x.dtype) for key, rotary in self.rotary.items()}
        first = self.layers[0].input_norm
        h = x if first is None else first(x)
        for layer, key, norm in zip(self.layers, self.rope_keys, self.next_norms):  # x: the stream, in place
            h = layer(h, x, *tables[key], meta, norm)
        return h

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits ``[N, vocab]`` for hidden rows ``[N, hidden]`` (scaled and soft-capped as the family does)."""
        cfg = self.config
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if cfg.logits_scaling is not None:
            logits = logits / cfg.logits_scaling
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def set_ops(self, ops: Ops) -> None:
        """Run the small per-layer ops with ``ops`` (runtime/kernels/fused.py)."""
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def attention_modules(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def moe_modules(self) -> list[SparseMoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
