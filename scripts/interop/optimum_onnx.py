"""Interop check: optimum-onnx's ORTModelForCausalLM loads our ONNX exports and generates our torch tokens.

Two halves, each run by its own interpreter (see optimum_onnx.sh):
  export WORK  (the project venv)  builds a tiny quantized llama, exports onnx and onnx-int4 into WORK,
               and writes the torch model's greedy tokens to WORK/expected.json;
  check WORK   (the optimum venv)  loads each export with ORTModelForCausalLM and compares its tokens.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

FORMATS = ("onnx", "onnx-int4")
NEW_TOKENS = 24


def export(work: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    from compress.exporters.dispatch import export as export_model
    from compress.format.checkpoint import build_quantization_config, save_quantized, set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme, quantize_weight

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    scheme = Scheme(bits=4, group_size=32, sym=False)
    with torch.no_grad():
        for name, lin in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]:
            lin.weight.normal_(0, 0.2)
            if name != "lm_head":
                set_module(model, name, QuantLinear.from_quantized(quantize_weight(lin.weight, scheme)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0])
    save_quantized(model, tokenizer, work / "quantized", build_quantization_config(model, "rtn", scheme))
    for fmt in FORMATS:
        export_model(str(work / "quantized"), fmt, work / fmt)
    prompt = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    (work / "expected.json").write_text(json.dumps({"prompt": prompt.tolist(), "tokens": tokens.tolist()}))


def check(work: Path) -> int:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import GenerationConfig

    expected = json.loads((work / "expected.json").read_text())
    prompt = torch.tensor(expected["prompt"])
    failures = 0
    for fmt in FORMATS:
        model = ORTModelForCausalLM.from_pretrained(work / fmt, use_cache=True, provider="CPUExecutionProvider")
        greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy).tolist()
        same = tokens == expected["tokens"]
        failures += not same
        print(f"optimum ORTModelForCausalLM {fmt}: {'same tokens as torch' if same else 'DIFFERENT tokens'}"
              f" ({len(tokens[0]) - prompt.shape[1]} new)")
        if not same:
            print(f"  torch:   {expected['tokens'][0]}\n  optimum: {tokens[0]}")
    print(f"{len(FORMATS) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "check"):
        sys.exit("usage: optimum_onnx.py export|check WORK_DIR")
    work = Path(sys.argv[2])
    if sys.argv[1] == "export":
        export(work)
    else:
        sys.exit(check(work))
