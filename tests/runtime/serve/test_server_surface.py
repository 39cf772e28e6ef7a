"""The serving surface vLLM users expect: served-model-name aliases, /tokenize, /detokenize, /tokenizer_info (what
lm-eval's remote tokenizer reads), a chat template override, and the engine knobs on `compress serve`."""
import httpx
import openai
import pytest

from test_server import KEY, Served, char_tokenizer, make_engine, model_dir  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def served(model_dir):  # noqa: F811
    s = Served(make_engine(model_dir), model_name=str(model_dir), api_key=KEY, served_model_names=("tiny", "tiny-2"))
    yield s
    s.close()


def test_served_model_names(served):
    c = served.client()
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-2"]
    r = c.completions.create(model="tiny-2", prompt="x", max_tokens=2)
    assert r.model == "tiny"
    with pytest.raises(openai.NotFoundError, match="tiny-2"):
        c.completions.create(model=str(served.engine.config.model), prompt="x", max_tokens=2)


def test_tokenize_detokenize_and_tokenizer_info(served):
    tok = char_tokenizer()
    r = httpx.post(served.url + "/tokenize", json={"prompt": "hello", "add_special_tokens": False})
    assert r.json()["tokens"] == tok("hello", add_special_tokens=False)["input_ids"] and r.json()["count"] == 5
    r = httpx.post(served.url + "/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.json()["token_strs"] == ["h", "i"] and r.json()["max_model_len"] == served.engine.max_model_len
    chat = httpx.post(served.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert httpx.post(served.url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == text
    bad = httpx.post(served.url + "/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(served.url + "/tokenize", json={"prompt": "x", "frob": 1}).status_code == 400
    info = httpx.get(served.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    from lm_eval.utils import check_remote_tokenizer_support
    assert check_remote_tokenizer_support(served.url + "/v1/completions")


def test_serve_command_passes_engine_knobs(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import runtime.serve.server
    from cli import main

    seen = {}
    monkeypatch.setattr(runtime.serve.server, "serve", lambda model, **kw: seen.update(model=model, **kw))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    args = ["serve", "m", "--served-model-name", "a", "--served-model-name", "b", "--kv-cache-memory", "64MiB",
            "--block-size", "8", "--no-enable-prefix-caching", "--max-num-batched-tokens", "512", "--draft", "ngram",
            "--num-speculative-tokens", "3", "--seed", "7", "--chat-template", str(template)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert seen["served_model_names"] == ("a", "b") and seen["chat_template"] == str(template)
    assert {k: seen[k] for k in ("kv_cache_memory", "block_size", "enable_prefix_caching", "max_num_batched_tokens",
                                 "num_speculative_tokens", "seed", "draft")} == {
        "kv_cache_memory": 64 << 20, "block_size": 8, "enable_prefix_caching": False, "max_num_batched_tokens": 512,
        "num_speculative_tokens": 3, "seed": 7, "draft": "ngram"}
    from runtime.config import EngineConfig
    EngineConfig(model="m", **{k: v for k, v in seen.items() if k not in (
        "model", "host", "port", "api_key", "max_queue", "served_model_names", "chat_template", "tool_call_parser")})


def test_chat_template_option(tmp_path):
    from runtime.serve.server import read_chat_template

    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(FileNotFoundError, match="chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_vllm_metric_names(served):
    served.client().completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(served.url + "/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    label = '{model_name="tiny"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total"):
        assert name + label in samples, name
    assert float(samples["vllm:generation_tokens_total" + label]) >= 3
    assert float(samples['vllm:request_success_total{finished_reason="length",model_name="tiny"}']) >= 1
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert "compress_generation_tokens_total" in samples  # ours stay beside them
