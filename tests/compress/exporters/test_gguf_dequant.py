"""compress/format/gguf_dequant.py (beside the GGUF export tests, whose tiny GGUFs it reads): a GGUF dequantized one tensor at a time gives exactly what transformers' whole-model GGUF loading gives."""
import pytest
import torch
from safetensors.torch import load_file

from compress.exporters.dispatch import export
from compress.format import gguf_dequant
from compress.format.quant import Scheme
from compress.format.shards import INDEX, shard_files

from .gguf_models import build


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in shard_files(folder):
        out.update(load_file(str(f)))
    return out


def test_equals_transformers_gguf_loading(tmp_path, monkeypatch):  # llama's q/k rows are reordered on the way
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(gguf_dequant, "PART_BYTES", 1 << 16)  # many part files, regrouped into one
    gguf = export(str(build(tmp_path / "q", "llama", Scheme(4, 32, True))), "gguf", tmp_path / "m.gguf")
    out = tmp_path / "fp"
    out.mkdir()
    gguf_dequant.dequantize_gguf(gguf.parent, gguf.name, out)
    got = _tensors(out)
    want = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).state_dict()
    want = {k: v for k, v in want.items() if k in got or k != "lm_head.weight"}
    assert got.keys() == want.keys()
    assert [k for k in got if not torch.equal(got[k], want[k])] == []
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.arange(12)[None]
    assert torch.equal(reloaded(ids).logits, AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)(ids).logits)


@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_shapes_transformers_does_not_read_come_from_the_metadata(tmp_path, family):
    """transformers 5.25 reads no head_dim (qwen3) or expert width (qwen2moe) from a GGUF, and builds wrong shapes;
    the lossless Q4_0 GGUF of a quantized checkpoint dequantizes back to that checkpoint's own function."""
    from transformers import AutoModelForCausalLM

    from compress.format.models import load_model

    from compress.exporters.gguf import GGUFOptions

    q = build(tmp_path / "q", family, Scheme(4, 32, True))
    # an F16 head, not the quantized model's default Q6_K/Q8_0 output, so only f16 rounding is left to compare
    gguf = export(str(q), "gguf", tmp_path / "m.gguf", options=GGUFOptions(output_type="f16"))
    out = tmp_path / "fp"
    out.mkdir()
    gguf_dequant.dequantize_gguf(gguf.parent, gguf.name, out)
    ids = torch.arange(12)[None]
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    want = load_model(str(q))[0](ids).logits
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the GGUF holds embeddings and norms in f16


def test_large_outputs_are_sharded(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_dequant, "PART_BYTES", 1 << 16)
    monkeypatch.setattr(gguf_dequant, "MAX_SHARD_BYTES", 1 << 17)
    gguf = export(str(build(tmp_path / "q", "llama", Scheme(4, 32, True))), "gguf", tmp_path / "m.gguf")
    out = tmp_path / "fp"
    out.mkdir()
    gguf_dequant.dequantize_gguf(gguf.parent, gguf.name, out)
    assert (out / INDEX).is_file() and len(shard_files(out)) > 1
