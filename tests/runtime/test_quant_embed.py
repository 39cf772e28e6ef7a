"""The runtime on checkpoints whose embedding and LM head are quantized: rows gathered from the codes, the head run
by the packed kernels from the same codes, no full-width fp table, greedy tokens as the eval (transformers) path."""
import pytest
import torch

from compress.config import load_recipe
from compress.format.checkpoint import load_quantized
from compress.format.qlinear import QuantEmbedding
from compress.job import quantize_to_folder
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model_runner import ForwardItem
from runtime.sequence import SamplingParams
from tiny_engine import hf_greedy, prompts, save_tiny
from tiny_models import FAMILIES, MOE_FAMILIES

N_NEW = 10
GREEDY = SamplingParams(max_tokens=N_NEW, ignore_eos=True)


def _quantized(tmp_path, family, tokenizer, embed, head, tied: bool | None = None):
    save_tiny(family, tmp_path / "fp", tokenizer, overrides=None if tied is None else {"tie_word_embeddings": tied})
    cfg = load_recipe("rtn4").replace(embed=embed, head=head)
    return quantize_to_folder(str(tmp_path / "fp"), cfg, str(tmp_path / "q")).out


def _tensors_of(module: torch.nn.Module):
    """Every tensor the module tree holds: parameters, buffers and plain tensor attributes (prepacked weights)."""
    for m in module.modules():
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))
        yield from m._parameters.values()
        yield from (b for b in m._buffers.values() if b is not None)


# llama and qwen2: untied (two tables); gemma: tied and scaled by sqrt(hidden) in the model; granite: a multiplier
@pytest.mark.parametrize("family,embed,head", [("llama", "int8", "int4"), ("gemma", "int8", "none"),
                                               ("qwen2", "int4", "int8"), ("granite", "int8", "none")])
def test_greedy_tokens_match_the_eval_path(tmp_path, smol_tokenizer, family, embed, head):
    out = _quantized(tmp_path, family, smol_tokenizer, embed, head)
    hf = load_quantized(out)
    engine = Engine(EngineConfig(model=out, kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32"))
    assert isinstance(engine.runner.model.embed_tokens, QuantEmbedding)
    ps = prompts(hf.config.vocab_size, (6, 19), seed=3)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [hf_greedy(hf, p, N_NEW) for p in ps]


GATHER_DEFAULT = [("gemma", True), ("llama", False)]
GATHER_SWEEP = [(f, t) for f in (*FAMILIES, *MOE_FAMILIES) for t in (False, True) if (f, t) not in GATHER_DEFAULT]


@pytest.mark.parametrize("family,tied", [*GATHER_DEFAULT, *(pytest.param(*c, marks=pytest.mark.slow)
                                                            for c in GATHER_SWEEP)],
                         ids=lambda v: v if isinstance(v, str) else ("tied" if v else "untied"))
def test_gather_and_packed_head_against_the_dequantized_reference(tmp_path, smol_tokenizer, family, tied):
    """Every family tied and untied (the sweep beyond gemma/llama is slow: ~5 s a case with a 49,152-row table)."""
    out = _quantized(tmp_path, family, smol_tokenizer, "int8", "int8", tied)
    hf = load_quantized(out)
    assert bool(hf.config.tie_word_embeddings) == tied
    engine = Engine(EngineConfig(model=out, kv_cache_memory=1 << 22, quant_kernel="auto", dtype="bfloat16"))
    model = engine.runner.model
    vocab, hidden = hf.config.vocab_size, hf.config.hidden_size
    ref_table = hf.get_input_embeddings().dequantized_weight()
    ids = torch.tensor([0, 5, vocab - 1, 5])
    torch.testing.assert_close(model.embed_tokens(ids).float(), ref_table[ids], rtol=1e-2, atol=0)  # bf16 rows
    assert engine.runner.lm_head_kind == "checkpoint" and "+" not in getattr(model.lm_head, "path", "")
    h = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
    ref_head = hf.get_output_embeddings().dequantized_weight()
    got, want = model.lm_head(h.to(torch.bfloat16)).float(), h @ ref_head.T
    assert (got - want).norm() / want.norm() < 2e-2  # bf16 or int8 activations
    # nothing holds a full-width floating-point [vocab, hidden] table
    assert not [t.shape for t in _tensors_of(model) if t.is_floating_point() and t.numel() >= vocab * hidden]
    # and the first step's logits follow the eval path
    p = prompts(vocab, (12,), seed=5)[0]
    got = engine.runner.forward([ForwardItem(p, 0, list(range(-(-len(p) // 16))), 1)])[0]
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0, -1]
    assert (got - want).norm() / want.norm() < 5e-2


def test_the_transformers_backend_serves_a_tied_quantized_table(tmp_path, smol_tokenizer):
    out = _quantized(tmp_path, "gemma", smol_tokenizer, "int4", "int4")
    hf = load_quantized(out)
    engine = Engine(EngineConfig(model=out, kv_cache_memory=1 << 22, quant_kernel="dequant", dtype="float32",
                                 model_impl="transformers"))
    assert engine.runner.model.lm_head is not None  # the tied head reads the embedding's codes
    ps = prompts(hf.config.vocab_size, (7,), seed=4)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [hf_greedy(hf, p, N_NEW) for p in ps]
