"""MHA/GQA -> GQA/MQA conversion, then optional brief uptraining by distillation from the original
model (compress/train.py, no fake quantization). Two ways to initialise the new heads (``init``):

* ``mean`` (Ainslie et al., 2023): each new key/value head is the mean of the old k_proj/v_proj heads
  (and biases) of the query heads it will serve; data-free.
* ``pca``: activation-aware, RoPE-compatible closed-form merging (compress/transforms/gqa_pca.py) from the
  attention inputs' second moment on calibration text; it also rewrites q_proj and o_proj. Models whose
  keys are normalised per head (qwen3's ``k_norm``) or partially rotated keep mean-pooled keys.

Query head ``h`` of ``H`` reads old KV head ``h // (H / K)``; after conversion to ``K'`` heads it reads
new head ``h // (H / K')``. With ``mean``, new head ``j`` is the mean, over the query heads of its group,
of the old head each of them read (``pca`` merges the same old heads). When ``K'`` divides ``K`` that is
the plain mean of ``K / K'`` whole old heads; any ``K'`` that divides ``H`` and does not exceed ``K``
works. A per-head-dim key norm (qwen3's ``k_norm``) is shared by all heads and stays as it is.

After either init, ``fit_steps`` fits each converted attention module to the original module's outputs,
one layer at a time (compress/transforms/gqa_fit.py), and ``steps`` of uptraining distil the whole model end to end.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from compress.config import KV_INITS, UPTRAIN_SCOPES
from compress.format.families import AttnLayout, require
from compress.methods.common.report import KVHeads
from compress.train import TrainConfig, TrainProgress, TrainResult, distill
from compress.transforms.gqa_fit import FitProgress, FitResult

log = logging.getLogger(__name__)


FIT_WINDOWS = 256  # calibration windows that layer-wise fitting learns from (32 batches of 8; 64 overfit)
FIT_BATCH = 8

def attn_layout(model_type: str) -> AttnLayout:
    return require(model_type, "gqa").attn


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


def _linear_like(lin: nn.Linear, weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A new nn.Linear in ``lin``'s dtype and device holding ``weight: [out, in]`` and ``bias``."""
    w = lin.weight
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=w.dtype, device=w.device)
    out.weight.data.copy_(weight)
    if bias is not None:
        out.bias.data.copy_(bias)
    return out


def _pooled_linear(lin: nn.Linear, n_heads: int, n_kv: int, new_kv: int) -> nn.Linear:
    w = pool_heads(lin.weight.data, n_heads, n_kv, new_kv)
    b = None if lin.bias is None else pool_heads(lin.bias.data, n_heads, n_kv, new_kv)
    return _linear_like(lin, w, b)


def _split_linear(lin: nn.Linear, aug: Tensor) -> nn.Linear:
    """``aug: [out, in + 1]`` (bias last) -> a Linear like ``lin`` (the bias column of a bias-free linear is 0)."""
    return _linear_like(lin, aug[:, :-1], aug[:, -1] if lin.bias is not None else None)


def rope_keys(config, layout: AttnLayout) -> bool:
    """Whether keys can be merged per RoPE plane: rotate_half RoPE over the whole head, no per-head k norm."""
    rope = getattr(config, "rope_parameters", None)
    partial = getattr(config, "partial_rotary_factor", None) or (rope.get("partial_rotary_factor")
                                                                   if isinstance(rope, dict) else None)
    return layout.rope_keys and (partial is None or partial >= 1)


def kv_input_moments(model: nn.Module, batches: list[Tensor]) -> list[Tensor]:
    """Per decoder layer, the augmented second moment of the attention input (k_proj's input)."""
    from compress.calibrate import decoder_layers
    from compress.transforms.gqa_pca import collect_input_moments

    layout = attn_layout(model.config.model_type)
    ks = [block.get_submodule(f"{layout.attn}.{layout.k}") for block in decoder_layers(model)]
    return collect_input_moments(model, batches, ks)


def _merge_block(attn: nn.Module, layout: AttnLayout, sigma: Tensor, n_heads: int, n_kv: int, new_kv: int,
                 rope: bool) -> None:
    """Replace q/k/v/o_proj of one attention module by their activation-aware merge."""
    from compress.transforms.gqa_pca import augmented, merge_attention

    lins = {n: attn.get_submodule(getattr(layout, n)) for n in ("q", "k", "v", "o")}
    m = merge_attention(augmented(lins["q"]), augmented(lins["k"]), augmented(lins["v"]),
                        lins["o"].weight.detach().double(), sigma.to(lins["q"].weight.device), n_heads, n_kv,
                        new_kv, rope)
    setattr(attn, layout.q, _split_linear(lins["q"], m.q))
    setattr(attn, layout.k, _split_linear(lins["k"], m.k) if m.k is not None else
            _pooled_linear(lins["k"], n_heads, n_kv, new_kv))
    setattr(attn, layout.v, _split_linear(lins["v"], m.v))
    setattr(attn, layout.o, _linear_like(lins["o"], m.o, lins["o"].bias))


@dataclass
class GQAReport:
    kv: KVHeads
    fit: FitResult | None = None
    uptrain: TrainResult | None = None


def check_scope(scope: str) -> None:
    if scope not in UPTRAIN_SCOPES:
        raise ValueError(f"uptraining scope {scope!r} is unknown; use one of {UPTRAIN_SCOPES}")


def check_init(init: str, batches: list[Tensor] | None) -> None:
    if init not in KV_INITS:
        raise ValueError(f"kv init {init!r} is unknown; use one of {KV_INITS}")
    if init == "pca" and not batches:
        raise ValueError("kv init 'pca' needs calibration text; give --calib (e.g. wiki) or use kv init 'mean'")


def convert(model: nn.Module, kv_heads: int, init: str = "mean", batches: list[Tensor] | None = None) -> GQAReport:
    """Reduce ``model``'s KV heads to ``kv_heads`` in place (``init``: "mean" pooling, or "pca" merging
    fitted on ``batches`` of token ids) and update its config."""
    from compress.calibrate import decoder_layers

    config = model.config
    layout = attn_layout(config.model_type)
    check_kv_heads(config, kv_heads)
    check_init(init, batches)
    n_heads, n_kv = config.num_attention_heads, kv_heads_of(config)
    before = kv_cache_bytes_per_token(config)
    blocks = decoder_layers(model)
    names = (layout.q, layout.k, layout.v, layout.o) if init == "pca" else (layout.k, layout.v)
    for block in blocks:
        for name in names:
            lin = block.get_submodule(f"{layout.attn}.{name}")
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"{layout.attn}.{name} is a {type(lin).__name__}; convert KV heads before quantizing")
    moments = kv_input_moments(model, batches) if init == "pca" else None
    rope = rope_keys(config, layout)
    if init == "pca" and not rope:
        log.info("%s: keys are normalised per head or partially rotated; keys mean-pooled, values merged",
                 config.model_type)
    for i, block in enumerate(blocks):
        attn = block.get_submodule(layout.attn)
        if moments is not None:
            _merge_block(attn, layout, moments[i], n_heads, n_kv, kv_heads, rope)
        else:
            for name in (layout.k, layout.v):
                setattr(attn, name, _pooled_linear(attn.get_submodule(name), n_heads, n_kv, kv_heads))
        if hasattr(attn, "num_key_value_groups"):
            attn.num_key_value_groups = n_heads // kv_heads
        for attr in ("num_key_value_heads", "num_kv_heads"):
            if hasattr(attn, attr):
                setattr(attn, attr, kv_heads)
    config.num_key_value_heads = kv_heads
    log.info("KV heads %d -> %d (%s): KV cache %d -> %d bytes/token (fp16)", n_kv, kv_heads, init, before,
             kv_cache_bytes_per_token(config))
    return GQAReport(KVHeads(n_kv, kv_heads, before, kv_cache_bytes_per_token(config)))


def uptrain(model: nn.Module, teacher: nn.Module, ids: Tensor, steps: int, lr: float, batch_size: int = 4,
            dtype: str = "bfloat16", seed: int = 0, progress: TrainProgress | None = None,
            scope: str = "blocks") -> TrainResult:
    """Distil ``teacher`` into the converted ``model``, training every decoder-block parameter
    (``scope="blocks"``) or only the attention modules' (``"attn"``); embeddings and the output head stay."""
    from compress.calibrate import decoder_layers

    check_scope(scope)
    blocks = decoder_layers(model)
    attn = attn_layout(model.config.model_type).attn
    params = list(blocks.parameters() if scope == "blocks" else
                  (p for b in blocks for p in b.get_submodule(attn).parameters()))
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
                        dtype: str = "bfloat16", seed: int = 0, progress: TrainProgress | None = None,
                        init: str = "pca", scope: str = "blocks", fit_steps: int = 0, fit_lr: float = 1e-3,
                        fit_progress: FitProgress | None = None) -> GQAReport:
    """Convert (``init``: see ``convert``), then (``fit_steps > 0``) fit each converted attention module
    to the original's outputs layer by layer (compress/transforms/gqa_fit.py), then (``steps > 0``) uptrain end to
    end against ``teacher`` (default: a copy of ``model`` as given)."""
    check_kv_heads(model.config, kv_heads)
    if (steps or fit_steps) and not batches:
        raise ValueError("training after --kv-heads (uptrain or fit steps) needs calibration text; "
                         "give --calib (e.g. wiki)")
    check_scope(scope)
    check_init(init, batches)
    if (steps or fit_steps) and teacher is None:
        teacher = copy.deepcopy(model)
    report = convert(model, kv_heads, init, batches)
    ids = torch.cat(list(batches)) if steps or fit_steps else None
    if fit_steps:
        from compress.transforms.gqa_fit import fit_to_teacher

        rows = ids[:FIT_WINDOWS].split(FIT_BATCH)
        report.fit = fit_to_teacher(model, teacher, list(rows), attn_layout(model.config.model_type).attn,
                                    fit_steps, fit_lr, seed, fit_progress, dtype)
        log.info("attention fitting: relative error %.4f -> %.4f in %.0f s", report.fit.mean_before,
                 report.fit.mean_after, report.fit.seconds)
    if steps:
        report.uptrain = uptrain(model, teacher, ids, steps, lr, batch_size, dtype, seed,
                                 progress, scope)
        log.info("uptraining: KL %.4f -> %.4f in %.0f s", report.uptrain.first, report.uptrain.last,
                 report.uptrain.seconds)
    return report


def convert_to_folder(model_spec: str, kv_heads: int, out: str, uptrain_steps: int = 0, lr: float = 5e-5,
                      calib: str = "wiki", nsamples: int = 512, seqlen: int = 256, batch_size: int = 4,
                      dtype: str = "bfloat16", seed: int = 0, overwrite: bool = False,
                      progress: TrainProgress | None = None, init: str = "pca", scope: str = "blocks",
                      fit_steps: int = 0, fit_lr: float = 1e-3, fit_progress: FitProgress | None = None) -> GQAReport:
    """Convert (and uptrain) ``model_spec`` and write it unquantized as a plain transformers folder
    (to measure what the conversion alone costs; quantize with ``kv_heads`` in a recipe to combine)."""
    from pathlib import Path

    from compress.data import calibration_batches
    from compress.format.checkpoint import atomic_dir
    from compress.format.models import load_model

    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True to replace it")
    model, tokenizer, _ = load_model(model_spec)
    check_kv_heads(model.config, kv_heads)
    needs_text = uptrain_steps or fit_steps or init == "pca"
    ids = calibration_batches(tokenizer, calib, nsamples, seqlen, seed) if needs_text else None
    report = convert_and_uptrain(model, kv_heads, None if ids is None else [ids], uptrain_steps, lr,
                                 batch_size=batch_size, dtype=dtype, seed=seed, progress=progress, init=init,
                                 scope=scope, fit_steps=fit_steps, fit_lr=fit_lr, fit_progress=fit_progress)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return report
