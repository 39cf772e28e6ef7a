"""The quantized checkpoint: an HF-style folder whose config records exactly how it was quantized.

Layout of a folder written by ``compress quantize``:
- ``config.json``: the model's config plus ``quantization_config`` =
  ``{"quant_method": "compress", "version": 1, "packing": "int32-lsb-first-along-in",
  "method": ..., "bits", "group_size", "sym", "format", "act_order",
  "modules": {linear name: {"bits", "group_size", "sym", "format", "act_order"}},
  "ignore": [fp linears], "ragged": {linear name: last group width}, "calibration": {...}}``, and for
  mixture-of-experts models ``"moe": {experts module: {scheme, "num_experts", shapes, "rtn_fallback"}}``
  (packed experts, see compress/format/moe_packed.py; routers stay fp), and ``"embed"``/``"head"`` (below).
  Every quantized linear is listed in ``modules``: per-layer exceptions are explicit, nothing is
  inferred from names or shapes.
- ``model.safetensors`` (or, from a streamed run, one shard per decoder block plus one for the rest,
  listed by ``model.safetensors.index.json``): fp tensors for everything else and, per quantized
  linear, ``qweight``/``scales``/``qzeros``/``g_idx`` as documented in compress/format/qlinear.py.
- tokenizer files and ``generation_config.json``.

The input embedding and the LM head (compress/methods/embed_head.py):
- ``"embed": {"name": "model.embed_tokens", "bits", "group_size", "sym", "format"} | null``. A quantized
  embedding ``E`` is stored exactly like a QuantLinear with ``out = vocab``, ``in = hidden``: ``E.qweight`` int32
  ``[vocab, ceil(hidden / (32 // bits))]`` packed along hidden, ``E.scales`` fp16 ``[vocab, n_groups]``,
  ``E.qzeros`` uint8 (asymmetric only); no ``E.weight``. It is not listed in ``modules`` (those are linears).
- ``"head": {"name": "lm_head", "tied": bool, "method": "rtn", "bits", "group_size", "sym", "format"} | null``.
  An untied quantized head is a QuantLinear under ``lm_head.*`` and is listed in ``modules`` as any linear; a tied
  model with a quantized embedding stores one tensor set, under the embedding's name, and no ``lm_head`` tensors:
  its head (``"tied": true``) reads the embedding's codes.
- Tensors that stay unquantized outside the blocks keep the source's dtype (bfloat16 for a GGUF source).
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from compress.format.moe_packed import PackedMoEExperts
from compress.format.qlinear import QuantEmbedding, QuantLinear
from compress.format.quant import Scheme

FORMAT_VERSION = 1
PACKING = "int32-lsb-first-along-in"


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False):
    """Yield a temporary folder beside ``out``; rename it into place only if the block succeeds."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _publishable(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name[-8:]}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publishable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; give the result the modes the umask allows."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    for p in [folder, *folder.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` inside ``model`` (the one module-swapping helper)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    """The quantized linears (a tied head, which reads the embedding's codes, is not one of its own)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not getattr(m, "tied", False)}


def module_entry(m: QuantLinear) -> dict:
    return {**m.scheme.to_dict(), "act_order": m.g_idx is not None}


def outer_entries(model: nn.Module) -> dict:
    """``quantization_config["embed"]`` and ``["head"]``: the quantized embedding and head, or None each."""
    emb = model.get_input_embeddings()
    embed = None
    if isinstance(emb, QuantEmbedding):
        name = next(n for n, m in model.named_modules() if m is emb)
        embed = {"name": name, **emb.scheme.to_dict()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    entry = None
    if isinstance(head, QuantLinear):
        entry = {"name": next(n for n, m in model.named_modules() if m is head),
                 "tied": bool(getattr(head, "tied", False)), "method": "rtn", **head.scheme.to_dict()}
    return {"embed": embed, "head": entry}


def build_quantization_config(model: nn.Module, method: str, scheme: Scheme, act_order: bool = False,
                              calibration: dict | None = None, extra: dict | None = None) -> dict:
    qmods = quantized_modules(model)
    ignore = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in qmods)
    ragged = {n: m.in_features % m.scheme.group(m.in_features) for n, m in qmods.items()
              if m.in_features % m.scheme.group(m.in_features)}
    moe = moe_entries(model)  # packed MoE experts (compress/format/moe_packed.py), listed only when present
    return {
        "quant_method": "compress", "version": FORMAT_VERSION, "packing": PACKING, "method": method,
        **scheme.to_dict(), "act_order": act_order,
        "modules": {n: module_entry(m) for n, m in qmods.items()},
        "ignore": ignore, "ragged": ragged, "calibration": calibration or {}, **({"moe": moe} if moe else {}),
        **outer_entries(model), **(extra or {}),
    }


def moe_entries(model: nn.Module) -> dict[str, dict]:
    """``quantization_config["moe"]``: every packed experts module, its scheme, shapes and fallbacks."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, PackedMoEExperts):
            out[name] = {**m.gate_up_proj.scheme.to_dict(), "act_order": m.gate_up_proj.g_idx is not None,
                         "num_experts": m.num_experts, "hidden_size": m.hidden_dim,
                         "intermediate_size": m.intermediate_dim, "gate_up": "concatenated",
                         "projections": {"gate_up_proj": [2 * m.intermediate_dim, m.hidden_dim],
                                         "down_proj": [m.hidden_dim, m.intermediate_dim]},
                         "rtn_fallback": list(getattr(m, "rtn_fallback", []))}
    return out


def save_quantized(model: nn.Module, tokenizer, out: str | Path, quantization_config: dict,
                   overwrite: bool = False, dtypes: dict[str, torch.dtype] | None = None) -> Path:
    """Write the quantized model atomically (temporary folder, then rename); ``dtypes`` names tensors
    stored in another dtype than the model's (the source's own, for those quantization does not touch)."""
    from safetensors.torch import save_file

    out = Path(out)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        cfg = model.config.to_dict()
        cfg["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        state = {k: v.to(dtypes[k]) if dtypes and k in dtypes else v for k, v in _unique_state(model).items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied duplicates (the first name, e.g. the input embedding, is kept)."""
    out, seen = {}, set()
    for k, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out[k] = t.detach().contiguous()
    return out


def read_quantization_config(path: str | Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compress":
        raise ValueError(f"{path} is not a checkpoint written by compress quantize (no compress quantization_config)")
    if qc.get("version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path} uses checkpoint version {qc['version']}; this compress reads up to {FORMAT_VERSION}")
    return qc


def scheme_of(entry: dict) -> Scheme:
    return Scheme(bits=entry["bits"], group_size=entry["group_size"], sym=entry["sym"], format=entry["format"],
                  zero_floor=entry.get("zero_floor", 0))


def swap_in_quant_linears(model: nn.Module, modules: dict[str, dict], dtype: torch.dtype) -> None:
    """Replace the named ``nn.Linear`` layers with empty :class:`QuantLinear` of the recorded scheme."""
    for name, entry in modules.items():
        lin = model.get_submodule(name)
        q = QuantLinear(lin.in_features, lin.out_features, scheme_of(entry), bias=lin.bias is not None,
                        act_order=entry.get("act_order", False), dtype=dtype)
        set_module(model, name, q)


def swap_in_packed_experts(model: nn.Module, entries: dict[str, dict]) -> None:
    """Replace each named fused experts module by an empty :class:`PackedMoEExperts` of the recorded scheme."""
    for name, entry in entries.items():
        old = model.get_submodule(name)
        packed = PackedMoEExperts.empty(entry["num_experts"], entry["hidden_size"], entry["intermediate_size"],
                                        scheme_of(entry), old.act_fn, entry.get("act_order", False))
        packed.rtn_fallback = list(entry.get("rtn_fallback", []))
        set_module(model, name, packed)


def dequantize_embedding(state: dict[str, torch.Tensor], entry: dict, hidden: int) -> None:
    """Replace a quantized embedding's ``E.qweight``/``scales``/``qzeros`` in ``state`` by its dequantized ``E.weight``
    (fp32), so a model of the family's own embedding module loads it."""
    from compress.format.quant import dequantize, unpack

    name, scheme = entry["name"], scheme_of(entry)
    q = unpack(state.pop(f"{name}.qweight"), scheme.bits, hidden)  # [vocab, words] -> [vocab, hidden]
    state[f"{name}.weight"] = dequantize(q, state.pop(f"{name}.scales"), state.pop(f"{name}.qzeros", None), scheme)


def load_quantized(path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                   dequantize_tables: bool = False) -> nn.Module:
    """Load a folder written by :func:`save_quantized` into QuantLinear modules (no fp weights). A quantized
    embedding becomes a :class:`QuantEmbedding` (a tied head reads its codes), or with ``dequantize_tables`` the
    family's own embedding module holding its dequantized values (the exporters, which read the codes from the
    files themselves and need the modules transformers' export paths know)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    qc = read_quantization_config(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config.quantization_config = None
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    swap_in_quant_linears(model, qc["modules"], dtype)
    tied_head = None if dequantize_tables else swap_in_quant_embedding(model, qc, dtype)
    if qc.get("moe"):
        swap_in_packed_experts(model, qc["moe"])
    from compress.format.shards import shard_files

    state = {}
    for f in shard_files(path):  # model.safetensors, or the shards a streamed run writes
        state.update(load_file(str(f)))
    if dequantize_tables and qc.get("embed"):
        dequantize_embedding(state, qc["embed"], config.hidden_size)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}'s weights do not match its config: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    if tied_head:
        set_module(model, tied_head, model.get_input_embeddings().as_linear())
    elif tied:
        model.tie_weights()
    return model.eval()


def swap_in_quant_embedding(model: nn.Module, qc: dict, dtype: torch.dtype) -> str | None:
    """Replace the input embedding by an empty :class:`QuantEmbedding` when ``qc["embed"]`` records one; returns
    the head's name when the head is tied to it (set once the codes are loaded)."""
    entry = qc.get("embed")
    if not entry:
        return None
    emb = model.get_submodule(entry["name"])
    set_module(model, entry["name"], QuantEmbedding(emb.num_embeddings, emb.embedding_dim, scheme_of(entry), dtype,
                                                    embed_scale=getattr(emb, "scalar_embed_scale", None)))
    head = qc.get("head") or {}
    return head["name"] if head.get("tied") else None
