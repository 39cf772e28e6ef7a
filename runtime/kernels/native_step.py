"""The decode rows of a whole model in one native call (runtime/kernels/cpu/decode_step.cpp), where its layers fit.

A batch-1 decode step of a small model is ~30 layers x a dozen ops; each op's Python and dispatch, and each
linear's own parallel region, cost about as much as the arithmetic. ``DecodeStep`` holds every layer's W8A8 weights,
norms and KV cache in C++, and one ``run`` goes from the embedded tokens to the final norm: norms, rotary, the KV
append, decode attention, the linears, the activation and the residual adds, inside one parallel region.

It takes the Llama form: pre norms (Gemma's ``1 + w`` too) or Gemma 2/3's sandwich norms, rotaries over all or the
first dims of each head (Phi-3), one per layer type (Gemma 3), optional q/k/v biases, optional per-head q/k norms
(Qwen3, Gemma 3), attention soft-capping (Gemma 2), Granite's residual multiplier, MHA/GQA/MQA, sliding windows, a
gated MLP, every linear on the W8A8 VNNI kernel, a KV cache in the compute dtype or 8-bit (int8 or fp8 codes with fp16
scales, runtime/kernels/kv_quant.py). What a layer needs beyond that is data (:func:`layer_needs`); the runner builds
the step once at load only when no layer needs anything (:func:`build`) and logs which path it chose and why. Prefill
rows, verification rows (several queries a sequence) and a model it refuses keep the per-op path
(runtime/models/blocks.py).
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from runtime.kernels import w8a8
from runtime.kernels.attention import AttentionMetadata
from runtime.kernels.fused import ACTIVATIONS, FUSED_CPU_OPS, Ops
from runtime.models.model_config import ModelConfig

log = logging.getLogger(__name__)

LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def w8a8_kernel(module: nn.Module) -> nn.Module | None:
    """The W8A8 kernel that runs ``module``'s decode rows with nothing around it (no permutation, padding), or None;
    a ``HybridLinear`` routes few rows to its ``small`` kernel."""
    kernel = getattr(module, "small", module)
    if getattr(kernel, "path", None) != "w8a8" or kernel.perm is not None or kernel.k_pad:
        return None
    return kernel


def layer_needs(layer: nn.Module, cfg: ModelConfig, index: int) -> list[str]:
    """What ``layer`` (layer ``index`` of a runtime/models/blocks.py decoder of ``cfg``) needs beyond the native
    step's form; empty when the step can run it."""
    attn, needs = layer.self_attn, []
    if cfg.arch.norms not in ("pre", "sandwich"):
        needs.append(f"{cfg.arch.norms} norms")
    if attn.norm_proj:
        needs.append("q/k norms over the whole projections")
    if attn.clip is not None:
        needs.append("clip_qkv")
    if cfg.moe is not None and index in cfg.moe.sparse_layers:
        needs.append("a sparse MoE MLP")
        return needs
    for parent, name in LINEARS:
        module = getattr(getattr(layer, parent), name)
        if w8a8_kernel(module) is None:
            needs.append(f"{name} on the {getattr(module, 'path', type(module).__name__)} path, not w8a8")
    return needs


def model_needs(model: nn.Module, ops: Ops, device_type: str) -> list[str]:
    """What the model as a whole needs beyond the step: the fused CPU kernels on a VNNI CPU, fp32 or bf16."""
    needs = []
    if device_type != "cpu" or ops is not FUSED_CPU_OPS:
        needs.append("the torch path (no fused CPU kernels)")
    elif not w8a8.available():
        needs.append("a CPU without AVX512-VNNI")
    if model.dtype not in (torch.float32, torch.bfloat16):
        needs.append(f"{model.dtype}")
    return needs


def layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    """A layer's norm weights and KV cache views, named as ``DecodeStep.add_layer`` takes them (the optional ones
    only where the layer has them)."""
    attn, (norm_in, attn_out, mlp_in, mlp_out) = layer.self_attn, layer.norms
    named = {"input_norm": norm_in, "attn_out_norm": attn_out, "mlp_norm": mlp_in, "mlp_out_norm": mlp_out,
             "q_norm": attn.q_norm, "k_norm": attn.k_norm}
    tensors = {name: norm.weight for name, norm in named.items() if norm is not None}
    caches = {"k_cache": attn.k_cache, "v_cache": attn.v_cache, "k_scale": attn.k_scale, "v_scale": attn.v_scale}
    return tensors | {name: t for name, t in caches.items() if t is not None}


class NativeStep:
    """Every layer of a model in one ``DecodeStep`` (see the module docstring); ``run`` replaces the layer loop."""

    def __init__(self, model: nn.Module):
        cfg, dtype = model.config, model.dtype
        self.step = torch.classes.compress_cpu.DecodeStep(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps,
            cfg.arch.norm_offset, model.layers[0].self_attn.scale, ACTIVATIONS[cfg.act][1], model.norm.weight)
        rope = {key: self.step.add_rotary(r.cos, r.sin) for key, r in model.rotary.items()}
        for layer, key in zip(model.layers, model.rope_keys):
            attn, multiplier = layer.self_attn, layer.residual_multiplier
            self.step.add_layer(layer_tensors(layer), attn.window or 0, attn.softcap or 0.0, rope[key],
                                1.0 if multiplier is None else multiplier)
            for parent, name in LINEARS:
                k = w8a8_kernel(getattr(getattr(layer, parent), name))
                bias = None if k.bias is None else k.bias.to(dtype)
                self.step.add_linear(k.weight, k.scale, k.szero, k.unscale, k.bits, k.group, k.out_features, k.lut,
                                     bias)
        self._run = self.step.run

    def run(self, x: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """Embedded tokens ``x [B, hidden]`` (one decode row a sequence; the stream, changed in place) -> the final
        norm of the stream ``[B, hidden]``, every layer's K and V stored."""
        return self._run(x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens)


def build(model: nn.Module, ops: Ops, device_type: str, enabled: bool = True) -> NativeStep | None:
    """The native step for ``model`` (its KV cache set), or None where any layer or the model needs what it lacks;
    logs the choice with its reasons."""
    if not enabled:
        log.info("decode step: per-op path (native_decode_step=False)")
        return None
    needs = model_needs(model, ops, device_type)
    if not needs:
        needs = [f"layer {i}: {n}" for i, layer in enumerate(model.layers) for n in layer_needs(layer, model.config, i)]
    if needs:
        shown = "; ".join(needs[:4]) + (f"; and {len(needs) - 4} more" if len(needs) > 4 else "")
        log.info("decode step: per-op path (the native step does not take %s)", shown)
        return None
    log.info("decode step: native, %d layers in one call (runtime/kernels/cpu/decode_step.cpp)", len(model.layers))
    return NativeStep(model)
