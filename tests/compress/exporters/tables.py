"""Quantized embeddings and LM heads for the export tests: rewrite a checkpoint saved today into the issue-32 format.

``with_tables`` copies a compress folder and quantizes its ``model.embed_tokens`` and/or ``lm_head`` by RTN with
compress.format.quant's functions, storing them exactly as a QuantLinear (``E.qweight``/``E.scales``/``E.qzeros``, no
``E.weight``) and recording ``quantization_config["embed"]``/``["head"]``. A tied model with a quantized embedding
keeps one tensor set (the head entry says ``tied``); an untied quantized head is also listed in ``modules``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from compress.format.quant import Scheme, compute_qparams, pack, quantize

EMBED, HEAD = "model.embed_tokens", "lm_head"


def _store(state: dict, name: str, scheme: Scheme) -> None:
    w = state.pop(f"{name}.weight").float()
    scale, zero = compute_qparams(w, scheme)
    state[f"{name}.qweight"] = pack(quantize(w, scale, zero, scheme), scheme.bits)
    state[f"{name}.scales"] = scale
    if zero is not None:
        state[f"{name}.qzeros"] = zero


def with_tables(src: Path, out: Path, embed: Scheme | None = None, head: Scheme | None = None) -> Path:
    """A copy of the checkpoint ``src`` at ``out`` with the embedding and/or head quantized (``None``: left fp)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    tied = bool(cfg.get("tie_word_embeddings"))
    assert not (tied and head is not None and embed is None), "a tied head is quantized through the embedding"
    state = load_file(str(out / "model.safetensors"))
    qc["embed"] = qc["head"] = None
    if embed is not None:
        _store(state, EMBED, embed)
        qc["embed"] = {"name": EMBED, **embed.to_dict()}
        if tied:
            qc["head"] = {"name": HEAD, "tied": True, **embed.to_dict()}
    if head is not None and not tied:
        _store(state, HEAD, head)
        qc["head"] = {"name": HEAD, "tied": False, **head.to_dict()}
        qc["modules"][HEAD] = {**head.to_dict(), "act_order": False}
        qc["ignore"] = [n for n in qc["ignore"] if n != HEAD]
        hidden = cfg["hidden_size"]
        if hidden % head.group(hidden):
            qc["ragged"][HEAD] = hidden % head.group(hidden)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out
