import copy
import json
import math

import pytest

from eval.report import SIZE_ON_DISK, evaluate, format_table


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smol_tokenizer, make_lm, rtn):
    """A tiny fp model folder and its 4-bit RTN quantized folder, both with the SmolLM2 tokenizer."""
    from compress.format.checkpoint import build_quantization_config, save_quantized
    from compress.format.quant import Scheme

    root = tmp_path_factory.mktemp("models")
    model = make_lm("llama", vocab=len(smol_tokenizer), tie=True)
    model.save_pretrained(root / "fp")
    smol_tokenizer.save_pretrained(root / "fp")
    q = rtn(copy.deepcopy(model))
    save_quantized(q, smol_tokenizer, root / "q4", build_quantization_config(q, "rtn", Scheme(bits=4, group_size=32)))
    return root / "fp", root / "q4"


def test_evaluate_baseline_vs_compressed(folders, text_file):
    fp, q4 = folders
    r = evaluate(str(q4), baseline_spec=str(fp), ppl_sources=[str(text_file)], tasks=["piqa"], limit=2, seqlen=64)
    base, comp, delta = r.baseline, r.compressed, r.delta
    src = str(text_file)
    for side, folder in ((base, fp), (comp, q4)):
        assert side.size_bytes == (folder / "model.safetensors").stat().st_size
        assert side.size_label == SIZE_ON_DISK
        assert math.isfinite(side.ppl[src]) and side.ppl_detail[src].windows >= 1
        assert side.accuracy["piqa"]["samples"] == 2
    assert comp.size_bytes < base.size_bytes
    assert delta.ppl[src] == pytest.approx(comp.ppl[src] - base.ppl[src])
    assert delta.accuracy["piqa"]["acc"] == pytest.approx(comp.accuracy["piqa"]["acc"] - base.accuracy["piqa"]["acc"])
    assert r["delta"]["ppl"] == delta.ppl and r["compressed"]["ppl_detail"][src]["windows"] >= 1  # the old keys
    table = format_table(r)
    for row in ("size", f"ppl {text_file.name}", "piqa acc_norm", "piqa acc", "avg accuracy"):
        assert row in table
    assert table.splitlines()[0].split() == ["baseline", "compressed", "delta"]


def test_cli_eval_writes_json(folders, text_file, tmp_path):
    from click.testing import CliRunner

    from cli import main

    fp, q4 = folders
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["eval", str(q4), "--baseline", str(fp), "--ppl", str(text_file), "--tasks", "piqa",
                                    "--limit", "2", "--seqlen", "64", "--max-windows", "3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "compressed" in res.output and "delta" in res.output
    saved = json.loads(out.read_text())
    for side in ("baseline", "compressed"):
        assert set(saved[side]["ppl"]) == {str(text_file)} and set(saved[side]["accuracy"]) == {"piqa"}
        assert saved[side]["ppl_detail"][str(text_file)]["windows"] == 3


def test_cli_eval_single_model_and_errors(folders, text_file):
    from click.testing import CliRunner

    from cli import main

    _, q4 = folders
    res = CliRunner().invoke(main, ["eval", str(q4), "--ppl", str(text_file), "--seqlen", "64"])
    assert res.exit_code == 0, res.output
    assert "baseline" not in res.output and "delta" not in res.output and "ppl story.txt" in res.output
    res = CliRunner().invoke(main, ["eval", str(q4), "--tasks", "piqa,mmlu"])
    assert res.exit_code == 2 and "error: unknown task(s) mmlu" in res.output
    res = CliRunner().invoke(main, ["eval", str(q4), "--ppl", "missing.txt"])
    assert res.exit_code == 2 and "missing.txt not found" in res.output
