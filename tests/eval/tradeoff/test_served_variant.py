"""`compress report --variants URL`: a running server of the report's own model scores the fp row's perplexity
on the same windows, gets speed columns from streamed requests, no size and no KL, and stays off the frontier;
a bad URL or key fails before any work."""
import json

import pytest
from click.testing import CliRunner

import cli
from .test_report import FAST

KEY = "report-key"


@pytest.fixture(scope="module")
def served(tiny_dir):
    from live_server import serve_folder

    s = serve_folder(tiny_dir, KEY, max_num_seqs=4)
    yield s
    s.close()


def test_a_served_variant_is_scored_as_compress_eval_server(tiny_dir, served, tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["compress", "report", "--api-key", KEY])
    out = tmp_path / "r"
    res = CliRunner().invoke(cli.main, ["report", str(tiny_dir), "--out", str(out), "--recipes", "fp32",
                                        "--variants", served.url + "/v1", "--api-key", KEY, *FAST],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "report.json").read_text())
    fp, url = result["rows"]
    assert url["kind"] == "served" and url["label"] == f"{tiny_dir.name}@{served.url.split('//')[1]}"
    assert url["error"] is None, url["error"]
    assert url["quality"]["ppl"]["wiki"] == pytest.approx(fp["quality"]["ppl"]["wiki"], rel=1e-3)
    assert url["quality"]["windows"] == fp["quality"]["windows"] and url["quality"]["size_bytes"] is None
    assert url["quality"]["kl"]["wiki"] is None and not url["pareto"]
    assert url["speed"]["runtime"] == "served" and url["speed"]["decode_tok_s"] > 0 and url["speed"]["output_tok_s"] > 0
    assert result["baseline"] == "fp32" and KEY not in (out / "report.json").read_text() + result["command"]
    md = (out / "report.md").read_text()
    assert url["label"] in md and "served over HTTP: no size" in md


def test_a_bad_server_fails_before_any_work(tiny_dir, served, tmp_path):
    for args, message in ((["--variants", served.url], "--api-key"),
                          (["--variants", "http://127.0.0.1:9/v1", "--api-key", KEY], "is the server running"),
                          (["--variants", served.url + "," + served.url, "--api-key", KEY], "given twice")):
        res = CliRunner().invoke(cli.main, ["report", str(tiny_dir), "--out", str(tmp_path / "r"), "--recipes", "",
                                            *args], env={"OPENAI_API_KEY": ""})
        assert res.exit_code == 2 and message in res.output, (args, res.output)
        assert not (tmp_path / "r").exists()
