"""An untied copy of a model: its LM head made a tensor of its own, equal to the embedding, saved as an HF folder.

The same function as the tied model (up to the saved dtype), so that an untied head's quantization (``--head``,
``--head-method``) can be measured on a real model whose vocabulary is large, e.g. SmolLM2 (tied 49,152 x 576):

    python scripts/bench/untie.py smollm2-135m out/smollm2-untied --dtype bfloat16
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


def main() -> None:
    from compress.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    model, tokenizer, _ = load_model(args.model)
    untie(model).to(getattr(torch, args.dtype)).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
