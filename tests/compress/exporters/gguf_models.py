"""Tiny quantized checkpoints for the GGUF tests: dense and MoE families with a small trained BPE tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

from compress.format.quant import Scheme

VOCAB = 300  # the tokenizer fills 290 ids: the last 10 rows exercise GGUF's [PAD] tokens
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def bpe_tokenizer():
    """A byte-level BPE with real merges and two special tokens, trained offline on one sentence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 8, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 unk_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _dense(family: str, hidden: int = 64):
    from transformers import AutoModelForCausalLM

    from .models import FAMILIES, tiny_config

    if family not in FAMILIES:  # qwen3: the shared tiny configs of tests/tiny_models.py
        from tiny_models import tiny_config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, hidden, vocab=VOCAB), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:  # wide enough for non-trivial rounding, scaled so logits stay as peaked at any width
                p.normal_(0, 0.2 * (64 / hidden) ** 0.5)
            elif "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _moe(family: str, scheme: Scheme):
    from tiny_models import tiny_model

    from compress.calibrate import decoder_layers
    from compress.config import QuantizeConfig
    from compress.format.families import FAMILIES
    from compress.methods.common import moe

    model = tiny_model(family, vocab=VOCAB, hidden=128)  # expert widths 96 / 128: whole 32-wide blocks
    cfg = QuantizeConfig(method="rtn", bits=scheme.bits, group_size=scheme.group_size, sym=scheme.sym)
    for i, block in enumerate(decoder_layers(model)):
        moe.quantize_block_experts(i, block, FAMILIES[family].experts, cfg)
    return model


def build(folder: Path, family: str, scheme: Scheme, act_order: bool = False, hidden: int = 64) -> Path:
    """Quantize a tiny random ``family`` model by RTN (lm_head and routers stay fp) and save it."""
    from compress.format.checkpoint import build_quantization_config, save_quantized

    from .models import quantize_model

    model = _moe(family, scheme) if family in MOE else _dense(family, hidden)
    model = quantize_model(model, scheme, act_order, skip=("lm_head", "gate", "shared_expert_gate"))
    qc = build_quantization_config(model, "rtn", scheme, act_order, extra={"recipe": "test", "source_model": family})
    return save_quantized(model, bpe_tokenizer(), folder, qc)


def rope_interleave(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """The test's own statement of llama.cpp's q/k row order: head row 2i + j is HF row j * d/2 + i."""
    d = w.shape[0] // n_head
    order = [h * d + j * (d // 2) + i for h in range(n_head) for i in range(d // 2) for j in range(2)]
    return w[order]
