"""`compress quantize` / `compress recipes` end to end on a tiny model, and their error cases."""
import json

import pytest
import torch
from click.testing import CliRunner

from cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_recipes_lists_each_with_a_description():
    res = run("recipes")
    assert res.exit_code == 0
    for name in ("awq4", "gptq4", "rtn4", "int8", "nf4"):
        assert name in res.output


def test_quantize_end_to_end_and_reload(tiny_dir, calib_text, tmp_path):
    out = tmp_path / "q"
    res = run("quantize", "--recipe", "gptq4", "--model", tiny_dir, "--calib", calib_text, "--nsamples", 4,
              "--seqlen", 32, "--group-size", 32, "--out", out, "--json", tmp_path / "summary.json")
    assert res.exit_code == 0, res.output
    assert "smaller" in res.output and f"wrote {out}" in res.output
    summary = json.loads((tmp_path / "summary.json").read_text())  # the keys scripts and the report read
    assert list(summary) == ["out", "report", "fp_bytes", "out_bytes", "seconds", "peak_rss_bytes", "streamed",
                             "memory", "recipe"]
    assert list(summary["report"]) == ["method", "seconds", "layers", "notes"] and len(summary["report"]["layers"]) == 14
    assert list(summary["report"]["layers"][0]) == ["layer", "name", "loss", "heldout_error", "rtn_heldout_error",
                                                    "choice", "names"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["fallback"] == summary["report"]["notes"]["fallback"]
    assert qc["method"] == "gptq" and qc["bits"] == 4 and qc["group_size"] == 32
    assert qc["calibration"] == {"source": str(calib_text), "nsamples": 4, "seqlen": 32, "seed": 0}
    assert len(qc["modules"]) == 15  # 2 blocks x 7 linears, and gptq4's int8 head (tiny llama: untied)
    assert qc["embed"]["bits"] == 8 and qc["head"]["bits"] == 8 and not qc["head"]["tied"]
    from compress.format.models import load_model

    model, tok, src = load_model(str(out))
    assert src.quantized
    with torch.no_grad():
        assert torch.isfinite(model(tok("hello world", return_tensors="pt").input_ids).logits).all()
    # an existing output is refused without --overwrite, and kept as it was
    before = (out / "model.safetensors").stat().st_mtime_ns
    res = run("quantize", "--recipe", "rtn4", "--model", tiny_dir, "--group-size", 32, "--out", out)
    assert res.exit_code == 2 and "--overwrite" in res.output
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    res = run("quantize", "--recipe", "rtn4", "--model", tiny_dir, "--group-size", 32, "--out", out, "--overwrite")
    assert res.exit_code == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["method"] == "rtn"


@pytest.mark.parametrize("args,msg", [
    (["--recipe", "nope"], "known recipes: "),
    (["--bits", "5"], "bits=5"),
    (["--group-size", "3"], "group_size=3"),
    (["--model", "/no/such/model"], "not found"),
])
def test_bad_input_is_one_clear_line(args, msg, tiny_dir, tmp_path):
    if "--model" not in args:
        args = [*args, "--model", tiny_dir]
    res = run("quantize", *args, "--out", tmp_path / "q")
    assert res.exit_code == 2
    assert res.output.startswith("error: ") and msg in res.output
    assert not (tmp_path / "q").exists()


def test_unknown_recipe_key(tiny_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: rtn\nbits: 4\ngroup_sise: 32\n")
    res = run("quantize", "--recipe", recipe, "--model", tiny_dir, "--out", tmp_path / "q")
    assert res.exit_code == 2 and "group_sise" in res.output


@pytest.mark.parametrize("text,msg", [("", "no text"), ("just a few words", "need at least seqlen")])
def test_empty_or_short_calibration_source(text, msg, tiny_dir, tmp_path):
    src = tmp_path / "c.txt"
    src.write_text(text)
    res = run("quantize", "--recipe", "awq4", "--model", tiny_dir, "--calib", src, "--seqlen", 64,
              "--out", tmp_path / "q")
    assert res.exit_code == 2 and msg in res.output, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # no partial or temporary folder


@pytest.mark.parametrize("stream,writer", [("--stream", "compress.stream.write_shard"),
                                           ("--no-stream", "compress.format.checkpoint._unique_state")])
def test_failure_mid_write_leaves_nothing(tiny_dir, tmp_path, monkeypatch, stream, writer):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(writer, boom)
    res = run("quantize", "--recipe", "rtn4", "--model", tiny_dir, "--group-size", 32, "--out", tmp_path / "q", stream)
    assert res.exit_code == 1 and "OSError: disk full" in res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("verbose", [False, True])
def test_a_fault_inside_a_step_is_one_line_naming_step_model_and_block(tiny_dir, tmp_path, monkeypatch, verbose):
    """A fault deep inside a method (here in GPTQ's block pass) on a model nobody tried: one line naming the command,
    the model type, the block and the cause, no traceback unless -v, a non-zero exit and no output folder."""
    def boom(*a, **k):
        raise AssertionError("Padding_idx must be within num_embeddings")

    monkeypatch.setattr("compress.methods.rtn.quantize_weight", boom)
    res = run(*(["-v"] if verbose else []), "quantize", "--recipe", "rtn4", "--model", tiny_dir, "--out",
              tmp_path / "q")
    lines = [line for line in res.output.splitlines() if line.startswith("error: ")]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: quantize failed on {tiny_dir} (model type llama) while quantizing block 0 of")
    assert lines[0].endswith("AssertionError: Padding_idx must be within num_embeddings")
    assert "-v" in res.output and ("Traceback" in res.output) == verbose
    assert not (tmp_path / "q").exists() and list(tmp_path.glob(".q.tmp-*")) == []


def test_killed_quantize_leaves_nothing(tiny_dir, tmp_path, calib_text):
    """SIGTERM mid-run (what a scheduler or `compress report` sends) removes the temporary output folder."""
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-c", "import cli; cli.main()", "quantize", "--recipe", "gptq4", "--model", str(tiny_dir),
           "--group-size", "32", "--calib", str(calib_text), "--nsamples", "64", "--seqlen", "64",
           "--out", str(tmp_path / "q")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".q.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None and list(tmp_path.glob(".q.tmp-*")), "no run to kill mid-write"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert list(tmp_path.iterdir()) == []
