"""MHA/GQA -> GQA/MQA conversion (Ainslie et al., 2023): each new key/value head is the mean of the
old k_proj/v_proj heads (and biases) of the query heads it will serve, then optional brief
uptraining by distillation from the original model (compress/train.py, no fake quantization).

Query head ``h`` of ``H`` reads old KV head ``h // (H / K)``; after conversion to ``K'`` heads it reads
new head ``h // (H / K')``. New head ``j`` is the mean, over the query heads of its group, of the old
head each of them read. When ``K'`` divides ``K`` that is the plain mean of ``K / K'`` whole old heads;
any ``K'`` that divides ``H`` and does not exceed ``K`` works. A per-head-dim key norm (qwen3's
``k_norm``) is shared by all heads and stays as it is.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.train import TrainConfig, TrainProgress, TrainResult, distill

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttnLayout:
    """Where a decoder block keeps its attention and which projections produce keys and values."""

    attn: str = "self_attn"
    k: str = "k_proj"
    v: str = "v_proj"


_STD = AttnLayout()
# olmo/olmoe normalise k over all KV heads at once (k_norm of width K * head_dim): no exact pooling, left out
ATTN_LAYOUTS: dict[str, AttnLayout] = {t: _STD for t in (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe")}


def attn_layout(model_type: str) -> AttnLayout:
    if model_type not in ATTN_LAYOUTS:
        raise ValueError(f"model_type {model_type!r} has no attention layout in compress/gqa.py; "
                         f"KV-head conversion supports: {', '.join(sorted(ATTN_LAYOUTS))}")
    return ATTN_LAYOUTS[model_type]


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_heads_of(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def allowed_kv_heads(n_heads: int, n_kv: int) -> list[int]:
    """KV-head counts reachable by pooling: divisors of the query heads, at most the current KV heads."""
    return [k for k in range(1, n_kv + 1) if n_heads % k == 0]


def check_kv_heads(config, kv_heads: int) -> None:
    n_heads, n_kv = config.num_attention_heads, kv_heads_of(config)
    allowed = allowed_kv_heads(n_heads, n_kv)
    if kv_heads not in allowed:
        why = (f"exceeds the current {n_kv} KV heads" if kv_heads > n_kv else
               f"does not divide the {n_heads} query heads" if kv_heads > 0 else "must be >= 1")
        raise ValueError(f"--kv-heads {kv_heads} {why}; allowed for this model: {allowed}")


def kv_cache_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token occupies: K and V, every layer, every KV head (fp16 by default)."""
    return 2 * config.num_hidden_layers * kv_heads_of(config) * head_dim(config) * dtype_bytes


def pool_heads(t: Tensor, n_heads: int, n_kv: int, new_kv: int) -> Tensor:
    """Pool KV heads of a k/v weight ``[n_kv * d, in]`` or bias ``[n_kv * d]`` -> ``[new_kv * d, ...]``."""
    assert n_heads % n_kv == 0 and n_heads % new_kv == 0 and new_kv <= n_kv
    rest = t.shape[1:]
    heads = t.reshape(n_kv, -1, *rest)  # [n_kv, d, ...]
    per_query = heads[torch.arange(n_heads) // (n_heads // n_kv)]  # [n_heads, d, ...]: the head each query reads
    pooled = per_query.float().reshape(new_kv, n_heads // new_kv, *per_query.shape[1:]).mean(dim=1)
    return pooled.reshape(-1, *rest).to(t.dtype)


def _pooled_linear(lin: nn.Linear, n_heads: int, n_kv: int, new_kv: int) -> nn.Linear:
    w = pool_heads(lin.weight.data, n_heads, n_kv, new_kv)
    out = nn.Linear(lin.in_features, w.shape[0], bias=lin.bias is not None, dtype=w.dtype, device=w.device)
    out.weight.data.copy_(w)
    if lin.bias is not None:
        out.bias.data.copy_(pool_heads(lin.bias.data, n_heads, n_kv, new_kv))
    return out


@dataclass
class GQAReport:
    kv_heads_before: int
    kv_heads_after: int
    kv_bytes_per_token_before: int  # fp16 KV cache
    kv_bytes_per_token_after: int
    uptrain: TrainResult | None = None


def convert(model: nn.Module, kv_heads: int) -> GQAReport:
    """Pool ``model``'s KV heads down to ``kv_heads`` in place and update its config."""
    from compress.calibrate import decoder_layers

    config = model.config
    layout = attn_layout(config.model_type)
    check_kv_heads(config, kv_heads)
    n_heads, n_kv = config.num_attention_heads, kv_heads_of(config)
    before = kv_cache_bytes_per_token(config)
    for block in decoder_layers(model):
        attn = block.get_submodule(layout.attn)
        for name in (layout.k, layout.v):
            lin = attn.get_submodule(name)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"{layout.attn}.{name} is a {type(lin).__name__}; convert KV heads before quantizing")
            setattr(attn, name, _pooled_linear(lin, n_heads, n_kv, kv_heads))
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = n_heads // kv_heads
        for attr in ("num_key_value_heads", "num_kv_heads"):
            if hasattr(attn, attr):
                setattr(attn, attr, kv_heads)
    config.num_key_value_heads = kv_heads
    log.info("KV heads %d -> %d: KV cache %d -> %d bytes/token (fp16)", n_kv, kv_heads, before,
             kv_cache_bytes_per_token(config))
    return GQAReport(n_kv, kv_heads, before, kv_cache_bytes_per_token(config))


def uptrain(model: nn.Module, teacher: nn.Module, ids: Tensor, steps: int, lr: float, batch_size: int = 4,
            dtype: str = "bfloat16", seed: int = 0, progress: TrainProgress | None = None) -> TrainResult:
    """Distil ``teacher`` into the converted ``model``, training every decoder-block parameter
    (embeddings and the output head stay as they are)."""
    from compress.calibrate import decoder_layers

    params = list(decoder_layers(model).parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    for p in teacher.parameters():
        p.requires_grad_(False)
    try:
        return distill(model, teacher, ids, [{"params": params, "lr": lr}],
                       TrainConfig(steps=steps, batch_size=batch_size, dtype=dtype, seed=seed), progress)
    finally:
        for p in model.parameters():
            p.requires_grad_(False)


def convert_and_uptrain(model: nn.Module, kv_heads: int, batches: list[Tensor] | None = None, steps: int = 0,
                        lr: float = 5e-5, teacher: nn.Module | None = None, batch_size: int = 4,
                        dtype: str = "bfloat16", seed: int = 0,
                        progress: TrainProgress | None = None) -> GQAReport:
    """Convert, then (``steps > 0``) uptrain against ``teacher`` (default: a copy of ``model`` as given)."""
    check_kv_heads(model.config, kv_heads)
    if steps and not batches:
        raise ValueError("uptraining after --kv-heads needs calibration text; give --calib (e.g. wiki)")
    if steps and teacher is None:
        teacher = copy.deepcopy(model)
    report = convert(model, kv_heads)
    if steps:
        report.uptrain = uptrain(model, teacher, torch.cat(list(batches)), steps, lr, batch_size, dtype, seed,
                                 progress)
        log.info("uptraining: KL %.4f -> %.4f in %.0f s", report.uptrain.first, report.uptrain.last,
                 report.uptrain.seconds)
    return report


def convert_to_folder(model_spec: str, kv_heads: int, out: str, uptrain_steps: int = 0, lr: float = 5e-5,
                      calib: str = "wiki", nsamples: int = 512, seqlen: int = 256, batch_size: int = 4,
                      dtype: str = "bfloat16", seed: int = 0, overwrite: bool = False,
                      progress: TrainProgress | None = None) -> GQAReport:
    """Convert (and uptrain) ``model_spec`` and write it unquantized as a plain transformers folder
    (to measure what the conversion alone costs; quantize with ``kv_heads`` in a recipe to combine)."""
    from pathlib import Path

    from compress.checkpoint import atomic_dir
    from compress.data import calibration_batches
    from compress.models import load_model

    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True to replace it")
    model, tokenizer, _ = load_model(model_spec)
    check_kv_heads(model.config, kv_heads)
    ids = calibration_batches(tokenizer, calib, nsamples, seqlen, seed) if uptrain_steps else None
    report = convert_and_uptrain(model, kv_heads, None if ids is None else [ids], uptrain_steps, lr,
                                 batch_size=batch_size, dtype=dtype, seed=seed, progress=progress)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return report
