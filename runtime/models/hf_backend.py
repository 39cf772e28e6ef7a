"""Any other decoder: transformers' own modeling code with the engine's paged KV cache plugged in.

For a ``model_type`` without a native runtime model (runtime/models/llama.py) the runtime loads the checkpoint as
a transformers ``AutoModelForCausalLM`` (HF folders, quantized folders with their QuantLinear layers, GGUF) and
registers :func:`paged_attention_forward` with transformers' ``AttentionInterface``, as vLLM's Transformers
backend does. A forward runs all scheduled tokens as one flattened batch-of-1 sequence with their own
``position_ids``; transformers builds no mask for an attention function it has no mask function for, and every
layer's attention call lands here with the layer's q/k/v (after the model's own RoPE, q/k norms, ...), its
``layer_idx`` and the engine's :class:`PagedForward`, passed through the forward's kwargs. K and V go into that
layer's share of the paged pool and the runtime's paged attention (torch, fused CPU or Triton, the runner's
choice, 8-bit caches included) answers, so continuous batching, prefix caching, chunked prefill and speculative
verification work as for native models, only slower (transformers' small ops, no fused qkv). Refused before any
weight is read (:func:`check_servable`): models whose transformers code does not pass those kwargs through
(``_supports_attention_backend``), ALiBi biases, K and V head sizes that differ (multi-head latent attention),
``layer_types`` other than full and sliding attention; at the first forward, any layer that never called the
attention function (state outside the KV cache would mix the flattened sequences).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.kernels.attention import AttentionMetadata, paged_attention
from runtime.models.llama import AttentionFn

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "compress_paged"  # the name registered with transformers' AttentionInterface
SERVABLE_LAYER_TYPES = ("full_attention", "sliding_attention")  # config.layer_types the paged attention runs

# How transformers' causal-LM heads post-process logits, keyed by the config field that turns each on (the keys
# vLLM's Transformers backend reads too): Gemma 2/3 soft-cap, Granite divides, Cohere multiplies.
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": lambda x, c: torch.tanh(x / c) * c,
    "logits_scaling": lambda x, c: x / c,
    "logit_scale": lambda x, c: x * c,
}


@dataclass(frozen=True)
class TransformersConfig:
    """What the engine and runner need from a model served by transformers' code (ModelConfig's field names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    remote_code: bool = False  # the checkpoint's own modeling code (trust_remote_code)

    @classmethod
    def from_hf(cls, cfg: dict, source: Path | None = None, trust_remote_code: bool = False) -> "TransformersConfig":
        """Check that transformers can serve ``cfg`` through the paged cache; raises ValueError naming the model
        type before any weight is read."""
        hf_config, remote = transformers_config(cfg, source, trust_remote_code)
        tc = hf_config.get_text_config()
        check_servable(cfg["model_type"], causal_lm_class(hf_config, source, remote), tc)
        heads, hidden = tc.num_attention_heads, tc.hidden_size
        kv_heads = getattr(tc, "num_key_value_heads", None) or getattr(tc, "num_kv_heads", None)
        if not kv_heads:
            kv_heads = 1 if getattr(tc, "multi_query", False) else heads
        max_pos = getattr(tc, "max_position_embeddings", None)
        if not max_pos:
            max_pos = 2048
            log.warning("%s names no max_position_embeddings; serving up to %d positions", cfg["model_type"], max_pos)
        return cls(model_type=cfg["model_type"], vocab_size=tc.vocab_size, hidden_size=hidden,
                   num_layers=tc.num_hidden_layers, num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=getattr(tc, "head_dim", None) or hidden // heads, max_position_embeddings=max_pos,
                   remote_code=remote)


def check_servable(model_type: str, model_class: type, tc) -> None:
    """Refuse what the paged cache cannot serve exactly: attention arguments not passed through, ALiBi biases,
    K and V head sizes that differ, layers that are not (sliding-window) attention."""
    why = None
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    v_dim = getattr(tc, "v_head_dim", None)
    layer_types = set(getattr(tc, "layer_types", None) or ()) - set(SERVABLE_LAYER_TYPES)
    if not model_class.is_backend_compatible():
        why = (f"transformers' {model_class.__name__} does not pass attention arguments through to its attention "
               "function (_supports_attention_backend)")
    elif getattr(tc, "alibi", False):
        why = "its ALiBi biases are added to the attention scores"
    elif getattr(tc, "kv_lora_rank", None) or (v_dim is not None and v_dim != head_dim):
        why = "it uses multi-head latent attention (K and V head sizes differ)"
    elif layer_types:
        why = f"it has {sorted(layer_types)} layers, which keep state outside a KV cache"
    if why:
        raise ValueError(f"model_type={model_type!r} cannot run on the runtime's paged KV cache: {why}")


def transformers_config(cfg: dict, source: Path | None, trust_remote_code: bool):
    """(transformers config object, whether it comes from the checkpoint's own code) for ``cfg``."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if not model_type:
        raise ValueError("the checkpoint's config.json names no model_type; the runtime cannot tell what model it is")
    auto_map = cfg.get("auto_map") or {}
    remote = "AutoModelForCausalLM" in auto_map
    if model_type not in CONFIG_MAPPING and not remote:
        raise ValueError(f"model_type={model_type!r} is unknown to transformers {transformers.__version__} and has "
                         "no native runtime model; upgrade transformers or serve a supported family")
    if remote and (trust_remote_code or model_type not in CONFIG_MAPPING):
        if not trust_remote_code:
            raise ValueError(f"model_type={model_type!r} needs the checkpoint's own Python code (auto_map); pass "
                             "--trust-remote-code (trust_remote_code=True) if you trust its source")
        if source is None:
            raise ValueError(f"model_type={model_type!r} needs its remote code, but the checkpoint has no folder")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source, trust_remote_code=True), True
    fields = {k: v for k, v in cfg.items() if k not in ("quantization_config", "auto_map")}
    return CONFIG_MAPPING[model_type].from_dict(fields), False


def causal_lm_class(hf_config, source: Path | None, remote: bool) -> type:
    """The transformers class that would load ``hf_config`` as a causal LM (no weights read)."""
    if remote:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(hf_config.auto_map["AutoModelForCausalLM"], str(source))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(hf_config, "is_encoder_decoder", False) or type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model_type={hf_config.model_type!r} has no decoder-only causal-LM class in transformers; "
                         "the runtime serves decoders only")
    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


class PagedLayer:
    """One layer's share of the engine's KV pool and the attention function to run on it (the runner fills
    these as it fills a native ``Attention``'s)."""

    def __init__(self, index: int):
        self.index = index
        self.k_cache: Tensor | None = None  # [num_blocks, block_size, Hkv, D]
        self.v_cache: Tensor | None = None
        self.k_scale: Tensor | None = None  # [num_blocks, block_size, Hkv] for an 8-bit cache
        self.v_scale: Tensor | None = None
        self.attn_fn: AttentionFn = paged_attention
        self.calls = 0  # attention calls answered (a layer never called is not attention: see TransformersLM)


@dataclass(frozen=True)
class PagedForward:
    """What one forward's attention calls need: the engine's metadata and every layer's pool."""

    meta: AttentionMetadata
    layers: list[PagedLayer]


def paged_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            runtime_attention: PagedForward | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function contract (``query: [1, Hq, T, D]``, ``key, value: [1, Hkv, T, D]`` ->
    ``([1, T, Hq, D], None)``) answered from the engine's paged KV cache of layer ``module.layer_idx``."""
    if runtime_attention is None:
        raise RuntimeError(f"{type(module).__name__} was called without the engine's paged context: this model's "
                           "transformers code does not pass attention kwargs through")
    if attention_mask is not None or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{type(module).__name__} adds its own attention bias or sinks, which the runtime's paged "
                         "attention does not apply")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} attends bidirectionally; the runtime serves causal decoders only")
    layer = runtime_attention.layers[module.layer_idx]
    layer.calls += 1
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
    if k.shape[1:] != layer.k_cache.shape[2:] or v.shape[1:] != layer.v_cache.shape[2:]:
        raise ValueError(f"layer {module.layer_idx} produced K/V heads {tuple(k.shape[1:])}/{tuple(v.shape[1:])}, "
                         f"the KV cache was sized from the config for {tuple(layer.k_cache.shape[2:])}")
    scale = scaling if scaling is not None else 1 / math.sqrt(q.shape[-1])
    o = layer.attn_fn(q, k, v, layer.k_cache, layer.v_cache, runtime_attention.meta, scale, sliding_window,
                      layer.k_scale, layer.v_scale, softcap=softcap or None)
    return o[None], None


def register_attention() -> None:
    """Make :func:`paged_attention_forward` a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


class TransformersLM(nn.Module):
    """A transformers causal LM behind the runtime's model contract: ``model(input_ids [T], positions [T], meta)``
    -> hidden ``[T, hidden]``, ``compute_logits(hidden rows)`` -> fp32 logits."""

    def __init__(self, hf: nn.Module, cfg: TransformersConfig, dtype: torch.dtype):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.decoder = hf.base_model  # embeddings, layers and the final norm; the head is ours
        if self.decoder is hf:
            raise ValueError(f"{type(hf).__name__} has no separate base model to run without its head")
        head, emb = hf.get_output_embeddings(), hf.get_input_embeddings()
        tied = getattr(head, "weight", None) is not None and head.weight is getattr(emb, "weight", None)
        self.lm_head: nn.Module | None = None if tied else head  # None: tied to the (fp) embeddings
        tc = hf.config.get_text_config()
        self.logit_transforms = [(LOGIT_TRANSFORMS[k], float(getattr(tc, k))) for k in LOGIT_TRANSFORMS
                                 if getattr(tc, k, None) not in (None, 1.0, 0.0)]
        self.paged_layers = [PagedLayer(i) for i in range(cfg.num_layers)]
        self.checked = False  # whether a forward has shown every layer to be attention

    @property
    def embed_tokens(self) -> nn.Module:
        return self.decoder.get_input_embeddings()

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None],
                           runtime_attention=PagedForward(meta, self.paged_layers))
        if not self.checked:  # a recurrent or convolution layer would mix the flattened sequences: refuse it
            skipped = [layer.index for layer in self.paged_layers if not layer.calls]
            if skipped:
                raise ValueError(f"{self.config.model_type}: layers {skipped} never called the attention function; "
                                 "their state lives outside the paged KV cache, so the runtime cannot serve them")
            self.checked = True
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits ``[N, vocab]`` for hidden rows ``[N, hidden]``, post-processed as the model's head does."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        for transform, value in self.logit_transforms:
            logits = transform(logits, value)
        return logits

    def set_ops(self, ops) -> None:
        """transformers' code runs its own small ops; the runner's choice applies to native models only."""

    def attention_modules(self) -> list[PagedLayer]:
        return self.paged_layers

    def moe_modules(self) -> list:
        return []


def load_transformers(src, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """``src`` (a ``compress.format.models.ModelSource``) as a transformers causal LM, as
    ``compress.format.models.load_model`` loads it (quantized folders with QuantLinear layers, GGUF dequantized once),
    without its tokenizer."""
    if src.quantized:
        from compress.format.checkpoint import load_quantized

        return load_quantized(src.path, dtype=dtype, trust_remote_code=trust_remote_code)
    if src.gguf_file:
        from compress.format.models import load_gguf

        return load_gguf(src, dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                use_safetensors=True)


def build_transformers_model(ckpt, dtype: torch.dtype, trust_remote_code: bool = False) -> TransformersLM:
    """Load ``ckpt`` with transformers (QuantLinear layers for a quantized folder) and wrap it for the runtime."""
    src = ckpt.source
    if src is None:
        raise ValueError(f"checkpoint {ckpt.name} has no folder to load with transformers")
    cfg = TransformersConfig.from_hf(ckpt.config, src.path, trust_remote_code)
    register_attention()
    hf = load_transformers(src, dtype, cfg.remote_code).eval()
    hf.config.use_cache = False  # the engine's pool is the cache: no DynamicCache per forward
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    return TransformersLM(hf, cfg, dtype).eval().requires_grad_(False)
