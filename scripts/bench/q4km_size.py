"""What a Q4_K_M GGUF of an HF model would weigh, from its tensor shapes and llama-quantize's rules, beside the
size of our checkpoints of it: the yardstick of the size targets (BENCHMARKS.md, "Large vocabularies").

llama-quantize's Q4_K_M (``llama_tensor_get_type``): Q4_K by default; Q6_K for the output head (a tied model's
token_embd, which then serves as the head) and for attn_v / ffn_down in the layers ``use_more_bits`` picks
(the first and last eighth, and every third between); norms and other 1-D tensors F32. A row length that is not
a whole number of 256-wide super-blocks falls back: Q4_K -> Q5_0, Q6_K -> Q8_0.

    python scripts/bench/q4km_size.py out/random-270m out/big/270m-rtn4 ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

BITS = {"Q4_K": 4.5, "Q5_0": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5, "F32": 32.0}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], n_layers: int, tied: bool) -> str:
    if len(shape) < 2:
        return "F32"
    if name.endswith("lm_head.weight") or (tied and name.endswith("embed_tokens.weight")):
        kind = "Q6_K"
    elif name.endswith(("v_proj.weight", "down_proj.weight")) and ".layers." in name:
        kind = "Q6_K" if use_more_bits(int(name.split(".layers.")[1].split(".")[0]), n_layers) else "Q4_K"
    else:
        kind = "Q4_K"
    return FALLBACK[kind] if shape[-1] % 256 else kind


def q4km_bytes(folder: Path) -> tuple[int, dict[str, int]]:
    """The Q4_K_M tensor bytes of an HF folder (metadata and tokenizer aside), and the parameters per type."""
    from compress.format.shards import ShardReader

    config = json.loads((folder / "config.json").read_text())
    entries = ShardReader(folder).entries
    n, tied = config["num_hidden_layers"], bool(config.get("tie_word_embeddings", False))
    total, per_type = 0.0, {}
    for name, e in entries.items():
        numel = 1
        for d in e.shape:
            numel *= d
        kind = tensor_type(name, tuple(e.shape), n, tied)
        per_type[kind] = per_type.get(kind, 0) + numel
        total += numel * BITS[kind] / 8
    return int(total), per_type


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp_model", type=Path, help="the HF folder the checkpoints were made from")
    ap.add_argument("checkpoints", type=Path, nargs="*", help="our checkpoints of it")
    args = ap.parse_args()
    ref, per_type = q4km_bytes(args.fp_model)
    print(f"{args.fp_model}: fp {folder_bytes(args.fp_model) / 2**20:,.1f} MiB, Q4_K_M {ref / 2**20:,.1f} MiB "
          f"({', '.join(f'{k} {v / 1e6:.1f}M' for k, v in sorted(per_type.items()))} parameters)")
    for ck in args.checkpoints:
        size = folder_bytes(ck)
        print(f"  {ck}: {size / 2**20:,.1f} MiB = {size / ref:.2f}x Q4_K_M")


if __name__ == "__main__":
    main()
