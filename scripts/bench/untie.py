"""An untied copy of a model: its LM head made a tensor of its own, equal to the embedding, saved as an HF folder.

The same function as the tied model (up to the saved dtype), so that an untied head's quantization (``--head``,
``--head-method``) can be measured on a real model whose vocabulary is large, e.g. SmolLM2 (tied 49,152 x 576):

    python scripts/bench/untie.py smollm2-135m out/smollm2-untied --dtype bfloat16

``--head-as-embedding`` goes the other way, to measure what a calibrated head would do to a tied table: a copy of a
checkpoint of the untied copy whose embedding rows are replaced by its quantized head's dequantized rows (the two are
then one table's values again, as if the head's codes were shared with the lookups):

    python scripts/bench/untie.py out/smol-u-h4-gptq out/smol-tied-from-gptq --head-as-embedding
"""
from __future__ import annotations

import argparse

import torch
from torch import nn


def untie(model: nn.Module) -> nn.Module:
    """In place: the head a separate parameter holding a copy of the embedding's rows."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    new = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, dtype=emb.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(emb.weight)
        if head.bias is not None:
            new.bias.copy_(head.bias)
    model.set_output_embeddings(new)
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.tie_word_embeddings = False
    assert model.get_output_embeddings().weight.data_ptr() != emb.weight.data_ptr()
    return model


def head_as_embedding(src: str, out: str) -> None:
    """Copy the checkpoint ``src`` to ``out`` with the embedding's rows set to the quantized head's values."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from compress.format.checkpoint import load_quantized

    head = load_quantized(src).get_output_embeddings()
    shutil.copytree(src, out)
    for f in Path(out).glob("*.safetensors"):
        tensors = load_file(str(f))
        if "model.embed_tokens.weight" in tensors:
            dtype = tensors["model.embed_tokens.weight"].dtype
            tensors["model.embed_tokens.weight"] = head.dequantized_weight().to(dtype)
            save_file(tensors, str(f), metadata={"format": "pt"})
            return
    raise ValueError(f"{src}: no full-width model.embed_tokens.weight to replace (embed: none is needed)")


def main() -> None:
    from compress.format.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--head-as-embedding", action="store_true",
                    help="MODEL is a checkpoint with a quantized untied head: copy it with the embedding = the head")
    args = ap.parse_args()
    if args.head_as_embedding:
        head_as_embedding(args.model, args.out)
        print(f"wrote {args.out}")
        return
    model, tokenizer, _ = load_model(args.model)
    untie(model).to(getattr(torch, args.dtype)).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
