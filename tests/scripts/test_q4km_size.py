"""scripts/bench/q4km_size.py: llama-quantize's Q4_K_M choice per tensor, and the bytes it adds up to."""
import json

import torch
from safetensors.torch import save_file

from bench_scripts import load_bench_script

q4km = load_bench_script("q4km_size")


def test_more_bits_for_the_first_and_last_eighth_and_every_third_between():
    assert [i for i in range(16) if q4km.use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_types_follow_the_rules_and_fall_back_on_partial_super_blocks():
    t = q4km.tensor_type
    assert t("model.embed_tokens.weight", (1000, 512), 16, tied=True) == "Q6_K"  # the tied table is the head
    assert t("model.embed_tokens.weight", (1000, 512), 16, tied=False) == "Q4_K"
    assert t("lm_head.weight", (1000, 640), 16, tied=False) == "Q8_0"  # 640 is 2.5 super-blocks: Q6_K -> Q8_0
    assert t("model.layers.0.mlp.down_proj.weight", (512, 1024), 16, tied=True) == "Q6_K"
    assert t("model.layers.2.mlp.down_proj.weight", (512, 1024), 16, tied=True) == "Q4_K"
    assert t("model.layers.2.self_attn.q_proj.weight", (512, 896), 16, tied=True) == "Q5_0"
    assert t("model.norm.weight", (512,), 16, tied=True) == "F32"


def test_bytes_add_up(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": torch.zeros(100, 256), "model.layers.3.mlp.up_proj.weight":
               torch.zeros(512, 256), "model.norm.weight": torch.zeros(256)}, str(tmp_path / "model.safetensors"))
    total, per_type = q4km.q4km_bytes(tmp_path)
    assert per_type == {"Q6_K": 25600, "Q4_K": 131072, "F32": 256}
    assert total == int(25600 * 6.5625 / 8 + 131072 * 4.5 / 8 + 256 * 4)
