"""`compress report` end to end on a tiny random model: files, resume after a failure, one more recipe,
and the errors that must come before any work."""
import json
import re
from html.parser import HTMLParser

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
