"""A model too large for copies of its weights is served from its packed codes and its fp head, nothing more."""
import pytest
import torch

from compress.config import load_recipe
from compress.job import quantize_to_folder
from runtime.cpu import cpu_info
from runtime.kernels import qmatmul
from runtime.lm import EngineLM
from tiny_engine import save_tiny


def test_lean_serving_keeps_no_copies(tmp_path, monkeypatch, smol_tokenizer):
    save_tiny("llama", tmp_path / "fp", smol_tokenizer)
    out = quantize_to_folder(str(tmp_path / "fp"), load_recipe("rtn4").replace(group_size=32, embed="none",
                                                                                     head="none"),
                             str(tmp_path / "q")).out  # an fp head, which the runtime rounds or keeps
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    full = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2, quant_kernel="hybrid")
    assert any("+" in p for p in full.runner.kernel_paths) and full.lm_head == "int8"
    monkeypatch.setattr(qmatmul, "COPY_BUDGET", 0.0)  # every copy is now over budget
    lean = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2)
    assert lean.lm_head == "fp" and lean.runner.num_prepacked == 0
    assert set(lean.runner.kernel_paths) <= {"int4pack", "int8pack", "dense"}, lean.runner.kernel_paths
    ref = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2, lm_head="fp")
    # the same integers through bf16 kernels: logits agree to bf16 rounding
    torch.testing.assert_close(lean(ids).logits, ref(ids).logits, rtol=0.05, atol=0.05)


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor storage the model holds (buffers, parameters, plain tensor attributes)."""
    seen = {}
    for m in model.modules():
        tensors = [v for v in vars(m).values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's prepacked weights: opaque, no storage to share
                seen[id(t)] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_default_startup_holds_the_codes_once_and_no_bf16_copies(tmp_path, smol_tokenizer):
    """rtn4 with a tied int8 embedding/head: the head's tiles are the embedding's bytes, no linear has a bf16 copy,
    and what the model holds is about the checkpoint's own tensors (scales widened to fp32 for the kernel)."""
    from compress.format.shards import ShardReader
    from runtime.kernels import w8a8
    from runtime.kernels.qmatmul import MkldnnLinear

    save_tiny("gemma", tmp_path / "fp", smol_tokenizer)  # tied embeddings
    out = quantize_to_folder(str(tmp_path / "fp"), load_recipe("rtn4"), str(tmp_path / "q")).out
    lm = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=1)
    if not w8a8.available():
        return  # the tiles need the VNNI kernels
    model = lm.runner.model
    assert not any(isinstance(m, (MkldnnLinear, w8a8.ScratchLinear)) for m in model.modules())
    assert isinstance(model.embed_tokens, w8a8.TiledEmbedding) and model.embed_tokens.head[0] is model.lm_head
    reader = ShardReader(out)
    stored = sum(e.nbytes for e in reader.entries.values())
    assert _held_bytes(model) < 1.15 * stored, (_held_bytes(model), stored)
    hybrid = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=1, quant_kernel="hybrid").runner.model
    copies = [m for m in hybrid.modules() if isinstance(m, MkldnnLinear)]  # the old path: bf16 copies of the linears
    assert copies and _held_bytes(hybrid) >= _held_bytes(model) + sum(2 * m.in_features * m.out_features
                                                                       for m in copies)


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_default_logits_are_as_close_to_exact_as_the_persistent_copies_path(tmp_path, smol_tokenizer, family):
    """The lean default against "hybrid" (the previous default), both against the exact dequantized model in fp32.
    Token by token both run the packed kernel: the same logits. On a prompt "hybrid" runs its bf16 copies; the
    default runs the packed kernel where it is the fastest (w8a8 without AMX: int8 activations, the decode step's
    numbers, so a prompt's logits equal decoding's) or the same bf16 GEMM from the scratch buffer (AMX)."""
    from runtime.kernels import w8a8

    save_tiny(family, tmp_path / "fp", smol_tokenizer)
    out = quantize_to_folder(str(tmp_path / "fp"), load_recipe("rtn4"), str(tmp_path / "q")).out
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    exact = EngineLM(out, dtype="float32", max_len=48, batch_size=1, quant_kernel="dequant", lm_head="fp",
                     fused_cpu=False)(ids).logits

    def logits(mode, kernel):
        return EngineLM(out, dtype="bfloat16", max_len=48, batch_size=1, mode=mode, quant_kernel=kernel)(ids).logits

    new_pre, new_dec, old_pre, old_dec = (logits(m, k) for k in ("auto", "hybrid") for m in ("prefill", "decode"))
    torch.testing.assert_close(new_dec, old_dec, rtol=0, atol=0)
    err = {name: float((x - exact).norm() / exact.norm())
           for name, x in (("new_pre", new_pre), ("old_pre", old_pre), ("old_dec", old_dec))}
    if w8a8.available() and not cpu_info().amx_bf16:
        torch.testing.assert_close(new_pre, new_dec, rtol=2e-2, atol=2e-2)  # one kernel: rounding order apart
        assert err["new_pre"] <= 1.05 * err["old_dec"], err
    else:
        assert err["new_pre"] <= 1.5 * err["old_pre"] + 1e-3, err
    agree = {k: float((x.argmax(-1) == exact.argmax(-1)).float().mean())
             for k, x in (("new", new_pre), ("old", old_dec))}
    assert agree["new"] >= agree["old"] - 0.05, agree


@pytest.mark.parametrize("mode, vnni, per_weight", [("auto", True, 1), ("hybrid", True, 3), ("auto", False, 2),
                                                    ("hybrid", False, 2)])
def test_the_copy_budget_counts_what_the_mode_keeps(monkeypatch, mode, vnni, per_weight):
    from compress.format import host
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme

    monkeypatch.setattr(qmatmul.w8a8, "available", lambda: vnni)
    assert qmatmul.added_bytes_per_weight(mode, fused=True) == per_weight
    model = torch.nn.Sequential(QuantLinear(1024, 1024, Scheme(bits=4, group_size=64)))  # 2**20 weights
    monkeypatch.setattr(host, "available_bytes", lambda: int(per_weight * 2**20 / qmatmul.COPY_BUDGET))
    assert not qmatmul.too_large_for_copies(model, mode)  # exactly at the budget
    monkeypatch.setattr(host, "available_bytes", lambda: int(per_weight * 2**20 / qmatmul.COPY_BUDGET) - 1)
    assert qmatmul.too_large_for_copies(model, mode)
