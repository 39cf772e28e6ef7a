"""A rotated checkpoint is a plain model of its family: the runtime and the exports load it unchanged."""
from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config

from compress.config import QuantizeConfig
from compress.format.checkpoint import build_quantization_config, load_quantized, save_quantized
from compress.pipeline import quantize_model

from .gguf_models import bpe_tokenizer

N_NEW = 10


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """A tiny tied-embedding Llama (as SmolLM2) quantized with a rotation, saved as a checkpoint folder."""
    from transformers import AutoModelForCausalLM

    tokenizer = bpe_tokenizer()
    cfg = tiny_config("llama", vocab=len(tokenizer))
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread-out weights so greedy tokens vary; norms away from 1 so folding is exercised
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    root = tmp_path_factory.mktemp("rotated")
    qcfg = QuantizeConfig(method="rtn", bits=4, group_size=32, sym=True, rotate="hadamard")
    report = quantize_model(model, qcfg)
    assert report.notes.rotate.untied_head
    save_quantized(model, tokenizer, root / "q", build_quantization_config(model, "rtn", qcfg.scheme))
    return root / "q"


def _greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_runtime_serves_the_rotated_checkpoint_like_transformers(rotated):
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    q = rotated
    hf = load_quantized(q)
    assert hf.config.tie_word_embeddings is False
    prompts = [[5, 17, 200, 9, 44], list(range(100, 121))]
    engine = Engine(EngineConfig(model=str(q), kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32"))
    outs = engine.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_greedy(hf, p) for p in prompts]


def test_gguf_export_of_the_rotated_checkpoint_reads_back_with_its_logits(rotated, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from compress.exporters.dispatch import export
    from compress.exporters.gguf import GGUFOptions
    from compress.format.models import load_model

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    q = rotated
    path = export(str(q), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    back, _, _ = load_model(str(path))
    ids = torch.randint(0, 290, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, load_quantized(q)(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.slow  # the dynamo ONNX export takes ~20 s; the unrotated tiny exports are checked in the default run
def test_onnx_export_of_the_rotated_checkpoint_runs_with_its_logits(rotated, tmp_path):
    pytest.importorskip("onnxruntime")
    from compress.exporters.dispatch import export
    from compress.exporters.onnx_runner import OnnxCausalLM, position_ids

    q = rotated
    out = export(str(q), "onnx", tmp_path / "onnx")
    ids = torch.randint(0, 290, (1, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    pos = torch.from_numpy(position_ids(mask.numpy(), ids.shape[1]))
    with torch.no_grad():
        want = load_quantized(q)(ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(OnnxCausalLM(out)(ids).logits, want, rtol=1e-4, atol=1e-4)
