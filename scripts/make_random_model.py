"""Write a Llama-shaped model with random weights as bf16 safetensors shards, for memory benchmarks.

No hub needed: the config is built here, the tokenizer is the embedded SmolLM2's (its ids are all
below these vocabularies), and every tensor is generated and written a slab of rows at a time, so
even the 8B shape (about 16 GB) is written in well under 1 GB of memory.

    python scripts/make_random_model.py --shape 8b --out out/random-8b
    python scripts/make_random_model.py --shape 1.5b --out out/random-1.5b
    python scripts/make_random_model.py --shape 0.5b --out out/random-0.5b   # also 1b, 270m: large vocabularies
    python scripts/make_random_model.py --shape 8b --layers 4 --out out/random-8b-4l   # the 8B block, fewer of them
"""
from __future__ import annotations

import argparse
import shutil
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Llama-shaped models of the sizes people bring, with their vocabularies and special ids (pad/bos/eos in the
# vocabulary's last rows for the Qwen-sized ones): Llama 3 8B; Qwen2-1.5B-, Qwen2-0.5B- and Llama-3.2-1B-sized
# ones; and a 270M with a 262,144-row tied embedding (over 60% of its parameters)
SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                 pad_token_id=151643, bos_token_id=151643, eos_token_id=151645),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128009, pad_token_id=128004, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "270m": dict(hidden_size=640, num_hidden_layers=18, intermediate_size=2048, num_attention_heads=4,
                 num_key_value_heads=1, vocab_size=262144, tie_word_embeddings=True, rope_theta=1000000.0,
                 pad_token_id=0, eos_token_id=1, bos_token_id=2),
}
STD = 0.02
SHARD_BYTES = 2 << 30


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    out["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def _slabs(name: str, shape: tuple[int, ...]):
    if len(shape) == 1:  # norms: ones
        yield torch.ones(shape, dtype=torch.bfloat16)
        return
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    step = max(1, (64 << 20) // (4 * shape[1]))
    for start in range(0, shape[0], step):
        rows = min(step, shape[0] - start)
        yield (torch.randn(rows, shape[1], generator=gen) * STD).to(torch.bfloat16)


def write(out: Path, shape: str | dict, layers: int | None, tokenizer=None) -> None:
    """``shape``: a name in SHAPES or such a dict of LlamaConfig fields; ``tokenizer``: saved beside the weights
    (default: the embedded SmolLM2's, which needs its package; scripts/bench/gpu_check_engine.py brings its own)."""
    from transformers import LlamaConfig

    from compress.format.checkpoint import atomic_dir
    from compress.format.models import load_tokenizer, resolve
    from compress.format.shards import Lazy, shard_name, write_index, write_shard

    c = {**(SHAPES[shape] if isinstance(shape, str) else shape), **({"num_hidden_layers": layers} if layers else {})}
    shapes = tensor_shapes(c)
    groups: list[dict] = [{}]
    size = 0
    for name, s in shapes.items():
        n = 2 * int(torch.tensor(s).prod())
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = Lazy(torch.bfloat16, s, lambda name=name, s=s: _slabs(name, s))
        size += n
    with atomic_dir(out, overwrite=True) as tmp:
        LlamaConfig(**{"max_position_embeddings": 8192, **c}, rms_norm_eps=1e-5, torch_dtype="bfloat16").save_pretrained(tmp)
        weight_map, total = {}, 0
        for k, group in enumerate(groups):
            name = shard_name(k + 1, len(groups))
            total += write_shard(tmp / name, group)
            weight_map.update({t: name for t in group})
            print(f"wrote {name} ({len(group)} tensors)", flush=True)
        write_index(tmp, weight_map, total)
        (tokenizer or load_tokenizer(resolve("smollm2-135m"))).save_pretrained(tmp)
    params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    print(f"{out}: {params / 1e9:.2f}B parameters, {total / 2**30:.1f} GiB bf16 in {len(groups)} shards")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None, help="Fewer decoder layers than the shape has.")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if shutil.disk_usage(args.out.resolve().parent if args.out.resolve().parent.exists() else Path.cwd()).free < 20 << 30:
        print("warning: less than 20 GiB free on the output disk", file=sys.stderr)
    write(args.out, args.shape, args.layers)


if __name__ == "__main__":
    main()
