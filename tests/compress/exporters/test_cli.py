"""`compress export` and `compress generate` from the command line: results, refusals and atomicity."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import EXPORT_FORMATS, main
from compress.exporters.dispatch import FORMATS

ROOT = Path(__file__).resolve().parents[3]


def test_cli_lists_the_dispatch_formats_without_loading_an_exporter():
    assert EXPORT_FORMATS is FORMATS
    help_text = "".join(CliRunner().invoke(main, ["export", "--help"]).output.split())
    assert all(name in help_text for name in FORMATS)
    # the CLI reads the list at import, and `compress --help` stays instant: no exporter, no torch
    code = "import sys, cli; assert not [m for m in sys.modules if m == 'torch' or m.startswith('compress.exporters.')" \
           " and m != 'compress.exporters.dispatch']"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_export_then_refuse_existing_output(quantized_dir, tmp_path):
    src, out = quantized_dir(family="llama"), tmp_path / "ct"
    r = CliRunner().invoke(main, ["export", str(src), "--format", "compressed-tensors", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert (out / "model.safetensors").is_file()
    r = CliRunner().invoke(main, ["export", str(src), "--format", "gptq", "--out", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output and "--overwrite" in r.output
    r = CliRunner().invoke(main, ["export", str(src), "--format", "gptq", "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert (out / "quantize_config.json").is_file()


@pytest.mark.parametrize("args,message", [
    (["--format", "ggml"], "unknown export format"),
    (["--format", "gptq", "--dtype", "fp8"], "--dtype 'fp8' is not a dtype"),
    (["--format", "onnx", "--dtype", "bfloat16"], "--format onnx does not take --dtype bfloat16"),
])
def test_bad_flags_are_one_line_errors(quantized_dir, tmp_path, args, message):
    r = CliRunner().invoke(main, ["export", str(quantized_dir(family="llama")), "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 2 and message in r.output and not (tmp_path / "o").exists()


def test_failed_export_leaves_no_folder(quantized_dir, tmp_path, monkeypatch):
    from compress.exporters import gptq

    def broken(source, folder, dtype):
        (folder / "model.safetensors").write_text("half written")
        raise ValueError("disk full")

    monkeypatch.setattr(gptq, "write", broken)
    r = CliRunner().invoke(main, ["export", str(quantized_dir(family="llama")), "--format", "gptq",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "disk full" in r.output
    assert list(tmp_path.iterdir()) == []


def test_generate_on_the_onnx_export_prints_the_torch_models_text(exported):
    from compress.exporters.onnx_runner import greedy_generate, load_causal_lm

    src, out = exported("onnx-int4", family="llama", group=32, sym=False)
    r = CliRunner().invoke(main, ["generate", str(out), "--prompt", "hello", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    model, tok = load_causal_lm(str(src))  # the quantized checkpoint in fp32, as the export computes it
    ids = tok("hello", return_tensors="pt").input_ids
    want = tok.decode(greedy_generate(model, ids, 8)[0, ids.shape[1]:], skip_special_tokens=True)
    assert r.output.strip() == want.strip() and want.strip()


def test_generate_prints_what_the_engine_serves(quantized_dir):
    from runtime import LLM, SamplingParams

    src = quantized_dir(family="llama")
    r = CliRunner().invoke(main, ["generate", str(src), "--prompt", "hello", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    served = LLM(str(src), kv_cache_memory=1 << 28).generate(["hello"], SamplingParams(max_tokens=8))[0].text
    assert r.output == served + "\n"
