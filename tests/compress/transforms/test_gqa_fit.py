import copy

import pytest
import torch
from test_gqa import _batches, _ids, _model

from compress.config import QuantizeConfig
from compress.pipeline import quantize_model
from compress.transforms import gqa
from compress.transforms.gqa_fit import AttentionIO, fit_attention, fit_to_teacher, relative_error


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fitting_lowers_every_merged_layers_error_and_moves_only_attention(family):
    base = _model(family, 8, 4)
    merged = copy.deepcopy(base)
    gqa.convert(merged, 2, "pca", _batches())
    merged.requires_grad_(False)
    res = fit_to_teacher(merged, base, _batches(n=32), "self_attn", steps=40, lr=1e-3)
    assert len(res.errors) == base.config.num_hidden_layers
    assert all(after < before for before, after in res.errors)
    assert not any(p.requires_grad or p.grad is not None for p in merged.parameters())  # left as found
    for a, b in zip(merged.model.layers, base.model.layers):
        assert torch.equal(a.mlp.down_proj.weight, b.mlp.down_proj.weight)
        assert torch.equal(a.input_layernorm.weight, b.input_layernorm.weight)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fitting_recovers_perturbed_attention_on_text_it_did_not_see(family):
    base = _model(family, 8, 4)
    student = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in student.model.layers:
            for p in layer.self_attn.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    held = _batches(n=16, seed=7)  # steps=0 only measures each layer's error

    def held_errors(m):
        return [before for before, _ in fit_to_teacher(m, base, held, "self_attn", 0, 1e-3).errors]

    first = held_errors(student)
    fit_to_teacher(student, base, _batches(n=32), "self_attn", steps=150, lr=3e-3)
    assert all(a < 0.5 * b for a, b in zip(held_errors(student), first))


def test_fit_attention_minimises_the_relative_error_of_the_recorded_outputs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    target = torch.nn.Linear(8, 8)
    xs = [torch.randn(4, 8) for _ in range(3)]
    with torch.no_grad():
        io = AttentionIO(xs, [target(x) for x in xs], [{} for _ in xs])
    before, after = fit_attention(lin, io, steps=300, lr=3e-2, dtype="float32")
    assert before > 0.3 and after < 1e-3
    assert relative_error(torch.ones(3), torch.ones(3)).item() == 0


def test_bf16_autocast_fits_like_fp32():  # the default dtype only rounds, it does not change what is fitted
    base = _model("llama", 8, 4)
    merged = copy.deepcopy(base)
    gqa.convert(merged, 2, "pca", _batches())
    runs = {d: fit_to_teacher(copy.deepcopy(merged), base, _batches(n=16), "self_attn", 30, 1e-3, dtype=d)
            for d in ("float32", "bfloat16")}
    for (b32, a32), (b16, a16) in zip(runs["float32"].errors, runs["bfloat16"].errors):
        assert b16 == pytest.approx(b32, rel=0.05) and a16 < b16
        assert a16 == pytest.approx(a32, rel=0.25)
    assert runs["float32"].errors != runs["bfloat16"].errors  # the dtype reached the forward passes


def test_an_exact_merge_measures_zero_error():  # replaying the recorded inputs and kwargs is faithful
    from test_gqa import _tie_heads

    base = _model("llama", 8, 4)
    _tie_heads(base, 4, 2)
    merged = copy.deepcopy(base)
    gqa.convert(merged, 2, "pca", _batches())
    res = fit_to_teacher(merged, base, _batches(), "self_attn", steps=0, lr=1e-4, dtype="float32")
    assert max(max(e) for e in res.errors) < 1e-8


def test_pipeline_fits_then_uptrains_and_reports_both():
    model = _model("llama", 8, 4)
    cfg = QuantizeConfig(method="rtn", bits=8, group_size=32, kv_heads=1, kv_fit_steps=10, uptrain_steps=2,
                         uptrain_scope="attn", train_dtype="float32")
    note = quantize_model(model, cfg, _batches()).notes.gqa
    assert note.fit.fit_error_after < note.fit.fit_error_before
    assert note.fit.fit_seconds > 0 and note.uptrain is not None
    with pytest.raises(ValueError, match="calibration text"):
        gqa.convert_and_uptrain(_model("llama", 8, 4), 1, None, fit_steps=5, init="mean")


@pytest.mark.parametrize("changes, msg", [
    ({"kv_fit_steps": 5}, "kv_fit_steps=5 trains a KV-head conversion; set kv_heads too"),
    ({"kv_heads": 1, "kv_fit_steps": -1}, "kv_fit_steps=-1 must be >= 0"),
    ({"kv_heads": 1, "kv_fit_lr": 2.0}, "kv_fit_lr=2.0 must be in"),
    ({"kv_heads": 1, "uptrain_scope": "mlp"}, "uptrain_scope='mlp' is unknown; use one of"),
])
def test_fit_and_scope_options_are_checked(changes, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        QuantizeConfig(method="rtn", **changes)


def test_cli_fits_the_merged_attention(tiny_dir, calib_text, tmp_path):
    from click.testing import CliRunner

    from cli import main

    args = ["quantize", "--recipe", "rtn4", "--model", str(tiny_dir), "--group-size", "32", "--kv-heads", "1",
            "--kv-fit-steps", "3", "--calib", str(calib_text), "--nsamples", "8", "--seqlen", "32",
            "--out", str(tmp_path / "q")]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "kv heads: 2 -> 1" in res.output and "attention fit error" in res.output
