"""Scoring a live server (eval/served.py): the served perplexity equals the in-process one on the same windows,
and `compress eval --server` gives the in-process accuracy through lm-eval's local-completions client."""
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eval.perplexity import perplexity
from eval.served import ServerTarget, check_echo, connect, served_perplexity, server_root, tokenizer_spec

KEY = "eval-key"


@pytest.fixture(scope="module")
def fp_dir(tmp_path_factory, smol_tokenizer, make_lm):
    """A tiny fp32 Llama with the SmolLM2 tokenizer, weights spread wider than the default init so the
    next-token distributions are far from uniform (and task scores are not ties)."""
    path = tmp_path_factory.mktemp("served") / "tiny"
    model = make_lm("llama", vocab=len(smol_tokenizer), tie=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    model.save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(fp_dir):
    from live_server import serve_folder

    s = serve_folder(fp_dir, KEY)
    yield s
    s.close()


def test_server_root_takes_the_spellings_clients_use():
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", "http://h:1/v1/completions"):
        assert server_root(url) == "http://h:1"
    with pytest.raises(ValueError, match="http"):
        server_root("127.0.0.1:8000")


def test_served_perplexity_equals_in_process(served, fp_dir, text_file):
    from transformers import AutoModelForCausalLM

    from compress.format.models import load_tokenizer, resolve

    endpoint = connect(served.url + "/v1", api_key=KEY)
    assert endpoint.model == str(fp_dir) and endpoint.max_model_len == 256
    tok = load_tokenizer(resolve(tokenizer_spec(endpoint, None)))  # the served folder, found from /v1/models
    check_echo(endpoint, tok)  # compress serve returns prompt logprobs: nothing raised
    texts = [text_file.read_text()]
    model = AutoModelForCausalLM.from_pretrained(fp_dir, dtype=torch.float32).eval()
    want = perplexity(model, tok, texts, seqlen=64, max_windows=5, batch_size=2)
    got = served_perplexity(endpoint, tok, texts, seqlen=64, max_windows=5, batch_size=2, concurrency=2)
    assert (got.windows, got.tokens) == (want.windows, want.tokens) == (5, 5 * 63)
    assert got.ppl == pytest.approx(want.ppl, rel=1e-4)
    assert abs(math.log(want.ppl / len(tok))) > 0.1  # not a uniform guess, where any scoring would agree


def test_bad_server_input_names_the_fix(served, tmp_path):
    with pytest.raises(ConnectionError, match="--api-key"):
        connect(served.url)
    with pytest.raises(ValueError, match="not served"):
        connect(served.url, api_key=KEY, model="other")
    endpoint = connect(served.url, api_key=KEY)
    with pytest.raises(FileNotFoundError, match="not found"):
        tokenizer_spec(endpoint, str(tmp_path / "missing"))
    remote = endpoint.__class__("http://x", "some/hub-name", "some/hub-name")
    with pytest.raises(ValueError, match="--tokenizer"):
        tokenizer_spec(remote, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(ConnectionError, match="is the server running"):
        connect(f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="concurrency"):
        ServerTarget(served.url, concurrency=0)


def test_eval_cli_needs_a_model_or_a_server():
    from click.testing import CliRunner

    from cli import main

    r = CliRunner().invoke(main, ["eval"])
    assert r.exit_code == 2 and "--server" in r.output
    r = CliRunner().invoke(main, ["eval", "m", "--tokenizer", "x"])
    assert r.exit_code == 2 and "apply to --server" in r.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if requests.get(url + "/health", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"compress serve did not come up at {url}")


@pytest.mark.slow
def test_compress_eval_server_matches_in_process(fp_dir, text_file, tmp_path):
    """`compress eval --server` against a live `compress serve` (a child process), beside the in-process
    evaluation of the same folder as --baseline: the same perplexity and the same accuracy per task."""
    import json

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cli", "serve", str(fp_dir), "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).parents[2], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        _wait_healthy(proc, url)
        out = tmp_path / "r.json"
        run = subprocess.run([sys.executable, "-m", "cli", "eval", "--server", url, "--baseline", str(fp_dir),
                              "--tasks", "piqa,arc_easy", "--limit", "8", "--ppl", str(text_file), "--seqlen", "64",
                              "--max-windows", "4", "--json", str(out), "-q"],
                             cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600)
    finally:
        proc.terminate()
        proc.wait(30)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    base, served = r["baseline"], r["compressed"]
    assert served["size_label"] == "served" and served["tokenizer"] == str(fp_dir)
    src = str(text_file)
    assert math.isclose(served["ppl"][src], base["ppl"][src], rel_tol=1e-4)
    for task in ("piqa", "arc_easy"):
        assert served["accuracy"][task]["samples"] == 8
        for metric in ("acc", "acc_norm"):
            assert served["accuracy"][task][metric] == pytest.approx(base["accuracy"][task][metric], abs=1e-9)
    assert "served" in run.stdout and "piqa acc_norm" in run.stdout


def test_table_names_the_served_column_and_has_no_size_for_it():
    from eval.report import format_table
    from eval.result import Delta, EvalResult, ModelResult, PplResult, Settings

    def side(size, label, ppl):
        return ModelResult(label, size, label, None, {"wiki": PplResult(ppl, 3.0, 10, 1)}, {}, None, {})

    base, served = side(100 << 20, "weight files on disk", 20.0), side(None, "served", 20.1)
    delta = Delta.between(base, served)
    assert delta.size_ratio is None and delta.ppl["wiki"] == pytest.approx(0.1)
    table = format_table(EvalResult(base, served, delta, Settings(512, 4, None)))
    head, _, model, size = table.splitlines()[:4]
    assert head.split() == ["baseline", "served", "delta"] and size.split()[-2:] == ["-", "-"]


@pytest.mark.parametrize("answer", ["refuse", "generated-only"])
def test_a_server_without_prompt_logprobs_is_refused_before_scoring(answer, smol_tokenizer):
    """llama-server's two answers to echo=true (ggml-org/llama.cpp#27174): a 400, or the generated token's logprob
    alone. lm-eval would score every choice alike from the second; the check refuses both, naming the server's
    limit."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"data": [{"id": "model.gguf"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if answer == "refuse":
                self._send(400, {"error": {"message": "Only no echo is supported", "type": "invalid_request_error"}})
            else:
                lp = {"tokens": ["x"], "token_logprobs": [-1.0], "top_logprobs": [{"x": -1.0}], "text_offset": [0]}
                self._send(200, {"choices": [{"index": 0, "text": "x", "logprobs": lp}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = connect(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ValueError, match="prompt logprobs for echo=true.*llama.cpp#27174"):
            check_echo(endpoint, smol_tokenizer)
    finally:
        server.shutdown()
