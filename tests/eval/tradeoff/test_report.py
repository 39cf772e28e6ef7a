"""`compress report` end to end on a tiny random model: files, resume after a failure, one more recipe,
and the errors that must come before any work."""
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

import cli

FAST = ["--ppl", "wiki", "--seqlen", "32", "--max-windows", "2", "--batch-size", "2", "--concurrency", "2",
        "--prompt-len", "8", "--output-len", "4", "--quiet"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    """A tiny random Llama folder with the SmolLM2 tokenizer (so the wiki text tokenizes as it will for real)."""
    return tiny_dir


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("report") / "r"


def report(*args):
    return CliRunner().invoke(cli.main, ["report", *map(str, args)], catch_exceptions=False)


class Resources(HTMLParser):
    """Every URL-like attribute value and every tag of an HTML page."""

    def __init__(self):
        super().__init__()
        self.urls, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v for k, v in attrs if k in ("src", "href", "srcset", "data", "poster")]


def test_a_failed_variant_keeps_its_error_and_the_others_go_on(tiny, out, monkeypatch):
    from eval.tradeoff import speed

    real = speed.measure_speed

    def flaky(spec, cfg):
        if "rtn4" in spec:
            raise RuntimeError("simulated crash")
        return real(spec, cfg)

    monkeypatch.setattr(speed, "measure_speed", flaky)
    res = report(tiny, "--out", out, "--recipes", "fp32,rtn4", *FAST)
    assert res.exit_code == 0, res.output
    rows = {r["label"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert rows["fp32"]["error"] is None and rows["fp32"]["speed"]["decode_tok_s"] > 0
    assert rows["rtn4"]["error"] == "speed: RuntimeError: simulated crash"
    assert rows["rtn4"]["quality"]["ppl"]["wiki"] > 0  # measured before the crash, and kept


def test_second_run_resumes_and_one_more_recipe_costs_only_that_recipe(tiny, out):
    res = report(tiny, "--out", out, "--recipes", "fp32,rtn4,int8", *FAST)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())
    assert sorted(result["cached_stages"]) == sorted(
        [f"{r['label']}-{r['key']}/{s}" for r in result["rows"] for s in ("quantize", "quality", "speed")
         if r["label"] == "fp32" and s != "quantize" or r["label"] == "rtn4" and s != "speed"])
    rows = {r["label"]: r for r in result["rows"]}
    assert all(r["error"] is None for r in rows.values()), rows
    fp, q4, q8 = rows["fp32"]["quality"], rows["rtn4"]["quality"], rows["int8"]["quality"]
    assert fp["kl"]["wiki"]["mean"] == 0 and q4["kl"]["wiki"]["mean"] > q8["kl"]["wiki"]["mean"] > 0
    assert q4["kl"]["wiki"]["p99"] >= q4["kl"]["wiki"]["mean"]
    assert fp["bits_per_weight"] == pytest.approx(32, rel=0.01) and q4["size_bytes"] < q8["size_bytes"] < fp["size_bytes"]
    assert rows["rtn4"]["made"]["quantize"]["peak_rss_bytes"] > 0 and rows["int8"]["speed"]["kv_bytes_per_token"] > 0
    assert any(r["pareto"] for r in rows.values()) and len(result["recommendations"]) == 3
    md = (out / "report.md").read_text()
    assert "| variant |" in md and "★" in md and "## Recommendations" in md and "ppl_vs_size.png" in md
    for png in ("ppl_vs_size.png", "kl_vs_size.png", "ppl_vs_speed.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_self_contained(out):
    page = (out / "report.html").read_text()
    parsed = Resources()
    parsed.feed(page)
    assert parsed.urls and all(u.startswith("data:image/png;base64,") for u in parsed.urls)
    assert not {"script", "link", "iframe", "object", "embed"} & set(parsed.tags)
    assert not re.search(r"url\(|@import|https?://", page)
    assert parsed.tags.count("img") == 3 and "<table>" in page


def test_errors_before_any_work(tiny, tmp_path):
    for args, message in (
            (["--recipes", "fp32,nosuchrecipe"], "recipe 'nosuchrecipe' not found"),
            (["--variants", str(tmp_path / "missing")], "no such folder or file"),
            (["--exports", "zip:rtn4"], "FORMAT:RECIPE"),
            (["--tasks", "nosuchtask"], "unknown task"),
            (["--max-size", "big"], "--max-size")):
        res = CliRunner().invoke(cli.main, ["report", str(tiny), "--out", str(tmp_path / "r"), *args])
        assert res.exit_code == 2 and message in res.output, (args, res.output)
        assert not (tmp_path / "r").exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    res = CliRunner().invoke(cli.main, ["report", str(tiny), "--out", str(tmp_path / "other")])
    assert res.exit_code == 2 and "no earlier report" in res.output


def test_fp_tables_pairs_each_recipe_that_quantizes_its_tables(tiny, tmp_path):
    """--fp-tables: beside rtn4 (int8 embedding/head) the same recipe with them full width, under its own key; int8
    (tables left full width already) gets no pair, and without the flag nothing changes."""
    from eval.tradeoff.config import ReportConfig
    from eval.tradeoff.variants import plan

    def variants(**kw):
        return plan(ReportConfig(model=str(tiny), out=str(tmp_path / "p"), recipes=("rtn4", "int8"), **kw))

    paired, plain = variants(fp_tables=True), variants()
    assert [v.label for v in paired] == ["rtn4", "rtn4-fp-tables", "int8"] and [v.label for v in plain] == ["rtn4", "int8"]
    assert paired[0] == plain[0] and paired[1].key != paired[0].key
    assert paired[1].overrides == (("embed", "none"), ("head", "none"))


@pytest.mark.slow  # two quantize child processes and three models measured: ~2 min on a shared 2-core machine
def test_fp_tables_rows_are_real_runs(tiny, tmp_path):
    """Both rows of the pair are quantized by `compress quantize` and measured: the full-width tables are larger."""
    out = tmp_path / "r"
    res = report(tiny, "--out", out, "--recipes", "fp32,rtn4", "--fp-tables", "--no-speed", *FAST)
    assert res.exit_code == 0, res.output
    rows = {r["label"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert list(rows) == ["fp32", "rtn4", "rtn4-fp-tables"] and all(r["error"] is None for r in rows.values())
    qc = {k: json.loads((Path(rows[k]["source"]) / "config.json").read_text())["quantization_config"]
          for k in ("rtn4", "rtn4-fp-tables")}
    assert qc["rtn4"]["embed"] is not None and qc["rtn4-fp-tables"]["embed"] is None
    assert rows["rtn4-fp-tables"]["overrides"] == {"embed": "none", "head": "none"}
    small, full = rows["rtn4"]["quality"], rows["rtn4-fp-tables"]["quality"]
    assert small["size_bytes"] < full["size_bytes"] and full["kl"]["wiki"]["mean"] > 0
    assert "rtn4-fp-tables: the recipe of the same name" in (out / "report.md").read_text()
