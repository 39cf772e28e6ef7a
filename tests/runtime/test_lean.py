"""A model too large for copies of its weights is served from its packed codes and its fp head, nothing more."""
import torch

from compress.config import load_recipe
from compress.job import quantize_to_folder
from runtime.kernels import qmatmul
from runtime.lm import EngineLM
from tiny_engine import save_tiny


def test_lean_serving_keeps_no_copies(tmp_path, monkeypatch, smol_tokenizer):
    save_tiny("llama", tmp_path / "fp", smol_tokenizer)
    out = quantize_to_folder(str(tmp_path / "fp"), load_recipe("rtn4").replace(group_size=32, embed="none",
                                                                                     head="none"),
                             str(tmp_path / "q")).out  # an fp head, which the runtime rounds or keeps
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    full = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2)
    assert any("+" in p for p in full.runner.kernel_paths) and full.lm_head == "int8"
    monkeypatch.setattr(qmatmul, "COPY_BUDGET", 0.0)  # every copy is now over budget
    lean = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2)
    assert lean.lm_head == "fp" and lean.runner.num_prepacked == 0
    assert set(lean.runner.kernel_paths) <= {"int4pack", "int8pack", "dense"}, lean.runner.kernel_paths
    ref = EngineLM(out, dtype="bfloat16", max_len=16, batch_size=2, lm_head="fp")
    # the same integers through bf16 kernels: logits agree to bf16 rounding
    torch.testing.assert_close(lean(ids).logits, ref(ids).logits, rtol=0.05, atol=0.05)
