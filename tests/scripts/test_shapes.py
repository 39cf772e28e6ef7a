"""The pure parts of scripts/bench/shapes.py: artifact names, option checks, GGUF bytes a token reads, bandwidth
shares, the tables (no llama.cpp, no model)."""
import ast
import json
import sys
from pathlib import Path

import pytest
from bench_scripts import BENCH, load_bench_script

SHAPES = ("0.5b", "1b", "1.5b", "8b", "270m")


@pytest.fixture(scope="module")
def sh():
    return load_bench_script("shapes")


@pytest.fixture(scope="module")
def cs():
    return load_bench_script("cpu_speed")


def test_module_level_imports_are_stdlib_only():
    """Importing the script loads nothing heavy (torch, the engine, gguf): those come inside functions."""
    tree = ast.parse((BENCH / "shapes.py").read_text())
    names = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
    assert names <= set(sys.stdlib_module_names) | {"__future__"}, names


def test_artifact_paths(sh, tmp_path):
    full = sh.artifact_paths(tmp_path, "0.5b", None)
    assert full.fp == tmp_path / "random-0.5b" and full.rtn4 == tmp_path / "random-0.5b-rtn4"
    assert (full.f16.name, full.q4km.name, full.ours.name) == ("random-0.5b-f16.gguf", "random-0.5b-q4_k_m.gguf",
                                                               "random-0.5b-rtn4.gguf")
    assert sh.artifact_paths(tmp_path, "1b", 2).q4km.name == "random-1b-2l-q4_k_m.gguf"  # fewer layers: own files


@pytest.mark.parametrize("values, want", [(["0.5b,1b"], ["0.5b", "1b"]), (["1b", "0.5b"], ["1b", "0.5b"]),
                                          (["0.5b, 0.5b"], ["0.5b"])])
def test_parse_shapes(sh, values, want):
    assert sh.parse_shapes(values, SHAPES) == want


@pytest.mark.parametrize("values", [["0.5B"], ["0.5b,2b"], [","]])
def test_parse_shapes_rejects_naming_the_choices(sh, values):
    with pytest.raises(ValueError, match="--shape .*choose from 0.5b, 1b"):
        sh.parse_shapes(values, SHAPES)


def _args(sh, *extra):
    return sh.parse_args(["--shape", "0.5b", *extra])


def test_validate_defaults(sh, cs):
    o = sh.validate(_args(sh), SHAPES, cs.parse_levels)
    assert (o.shapes, o.layers, o.repeats, o.levels, o.prompts) == (["0.5b"], None, 3, [16], [128, 512])
    assert o.work == Path("out/shapes").resolve() and o.work.is_absolute()


@pytest.mark.parametrize("extra, match", [(["--repeats", "0"], "--repeats 0"), (["--layers", "0"], "--layers 0"),
                                          (["--threads", "0"], "--threads 0"), (["--prompts", "128,x"], "--prompts"),
                                          (["--parallel", "0"], "--parallel"), (["--bandwidth-gib", "0.01"],
                                                                                "--bandwidth-gib")])
def test_validate_rejects(sh, cs, extra, match):
    with pytest.raises(ValueError, match=match):
        sh.validate(_args(sh, *extra), SHAPES, cs.parse_levels)


def test_gguf_token_bytes_tied_reads_the_whole_table(sh):
    tied = [("token_embd.weight", 151936 * 896, 151936), ("blk.0.attn_q.weight", 500, 896), ("output_norm.weight",
                                                                                              3584, 1)]
    assert sh.gguf_token_bytes(tied) == 151936 * 896 + 500 + 3584  # the table is the head: all of it, every token
    untied = tied + [("output.weight", 1000, 10)]
    assert sh.gguf_token_bytes(untied) == 896 + 500 + 3584 + 1000  # the embedding: one row


def test_bandwidth_arithmetic(sh):
    used = sh.bandwidth_used(300 * 2**20, 40.0)
    assert used == pytest.approx(300 * 2**20 * 40)
    assert sh.share(used, 2 * used) == pytest.approx(0.5)
    assert sh.bandwidth_used(None, 40.0) is None and sh.share(None, 1e9) is None and sh.share(1.0, 0.0) is None


def test_speed_rows_medians_and_ratios(sh):
    runs = {"engine": {"tg128": [30.0, 10.0, 20.0], "pp128": [100.0]},
            "q4km": {"tg128": [40.0, 40.0, 50.0], "pp128": [0.0]},
            "ours": {"tg128": [10.0]}}
    rows = {r.key: r for r in sh.speed_rows(runs, [("pp128", "pp128 tok/s"), ("tg128", "tg128 tok/s")])}
    assert rows["tg128"].values == {"engine": 20.0, "q4km": 40.0, "ours": 10.0}
    assert rows["tg128"].ratio("q4km") == pytest.approx(0.5) and rows["tg128"].ratio("ours") == pytest.approx(2.0)
    assert rows["pp128"].ratio("q4km") is None and rows["pp128"].ratio("ours") is None  # zero / missing: no ratio


def test_format_speed_and_reads(sh):
    rows = [sh.SpeedRow("tg128 tok/s", "tg128", {"engine": 60.0, "q4km": 50.0, "ours": None})]
    lines = sh.format_speed(rows).splitlines()
    assert lines[0] == ("| metric | engine rtn4 | llama.cpp Q4_K_M | engine / Q4_K_M | llama.cpp rtn4 GGUF (Q4_1) | "
                        "engine / rtn4 GGUF (Q4_1) |")
    assert lines[2] == "| tg128 tok/s | 60.0 | 50.0 | 1.20x | - | - |"
    assert all(line.count("|") == 7 for line in lines)
    reads = sh.format_reads({"engine": 100 * 2**20, "q4km": 80 * 2**20, "ours": None},
                            {"engine": 50.0, "q4km": 60.0, "ours": 55.0}, 20e9).splitlines()
    assert reads[0].endswith("| of measured 20.0 GB/s |")
    assert reads[2] == "| engine rtn4 | 100.0 | 50.0 | 5.24 | 26% |"  # 100 MiB x 50 / 20 GB/s
    assert reads[3] == "| llama.cpp Q4_K_M | 80.0 | 60.0 | 5.03 | 25% |"
    assert reads[4] == "| llama.cpp rtn4 GGUF (Q4_1) | - | 55.0 | - | - |"


def test_describe(sh):
    config = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    assert sh.describe(config) == "hidden 896, 24 layers, 14/2 heads, MLP 4864, vocab 151936, tied"


def test_cpu_label(sh):
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n" \
           "stepping\t: 1\nprocessor\t: 1\ncpu family\t: 99\n"
    assert sh.cpu_label(text, "AMD EPYC") == "AMD EPYC (cpu family 25, model 17, stepping 1)"
    assert sh.cpu_label("", "unknown CPU") == "unknown CPU"


def test_shape_json_carries_ratios_and_bandwidth_shares(sh, tmp_path):
    rows = [sh.SpeedRow("tg128 tok/s", "tg128", {"engine": 50.0, "q4km": 40.0, "ours": None})]
    res = {"rows": rows, "token_bytes": {"engine": 10**8, "q4km": 2 * 10**8, "ours": 10**8}}
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "intermediate_size": 128, "vocab_size": 1000}
    got = sh.shape_json(res, config, sh.artifact_paths(tmp_path, "1b", 2), 20e9, 128)
    assert got["rows"][0]["engine/q4km"] == pytest.approx(1.25) and got["rows"][0]["engine/ours"] is None
    assert got["decode_gbs"] == {"engine": pytest.approx(5.0), "q4km": pytest.approx(8.0), "ours": None}
    assert got["bandwidth_share"] == {"engine": pytest.approx(0.25), "q4km": pytest.approx(0.4), "ours": None}
    assert got["config"].endswith("vocab 1000, untied")
    assert got["artifacts"]["q4km"].endswith("random-1b-2l-q4_k_m.gguf")
    json.dumps(got)  # plain data


def test_prepare_only_skips_what_exists(sh, tmp_path, capsys):
    """Every artifact present: nothing is run (no llama.cpp, no quantize), the paths are listed, no measuring."""
    art = sh.artifact_paths(tmp_path, "0.5b", 2)
    for folder in (art.fp, art.rtn4):
        folder.mkdir()
    for f in (art.f16, art.q4km, art.ours):
        f.write_bytes(b"")
    sh.main(["--shape", "0.5b", "--layers", "2", "--work", str(tmp_path), "--llamacpp-bin", str(tmp_path / "none"),
             "--prepare-only"])
    got = json.loads(capsys.readouterr().out)
    assert got == {"0.5b": {"artifacts": {k: str(getattr(art, k)) for k in ("fp", "rtn4", "f16", "q4km", "ours")},
                            "seconds": {}}}
