"""The OpenAI-compatible server end to end: the real `openai` client and httpx on loopback, the real
Engine on a tiny random Llama saved to a folder with a byte-level tokenizer and a chat template."""
import asyncio
import json
import os
import time

import pytest
import torch
from live_server import Served, char_tokenizer, model_dir  # noqa: F401 (re-exported to the other server tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEY = "test-key"
MAX_MODEL_LEN = 128
def make_engine(model_dir, max_num_seqs=8):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig(model=str(model_dir), max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                               kv_cache_memory=8 << 20, block_size=16))


@pytest.fixture(scope="module")
def served(model_dir):
    s = Served(make_engine(model_dir), model_name=str(model_dir), api_key=KEY, max_num_seqs=8, max_queue=128)
    yield s
    s.close()


def blocks_free(engine) -> bool:
    """Every KV block back in the pool (blocks kept only for the prefix cache count as free)."""
    s = engine.stats()
    return not engine.has_unfinished() and s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0


def wait_until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def hf_greedy(model_dir):
    """Greedy continuation by transformers, the reference for the engine's greedy output."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)

    def run(ids: list[int], n: int) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True)
    return run, tok


def test_completion_matches_transformers_greedy(served, hf_greedy):
    run, tok = hf_greedy
    prompt = "The river left the mountains"
    r = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    ids = tok(prompt)["input_ids"]
    assert r.choices[0].text == run(ids, 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)


def test_streamed_completion_equals_unstreamed(served):
    c = served.client()
    kw = dict(model=served.model, prompt="A small town grew", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0].text
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_streaming_and_not(served, hf_greedy):
    run, tok = hf_greedy
    c = served.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    kw = dict(model=served.model, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == run(ids, 8)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_and_seed(served):
    c = served.client()
    base = dict(model=served.model, prompt="Every evening the bells", max_tokens=16, extra_body={"ignore_eos": True})
    greedy = c.completions.create(temperature=0, **base).choices[0].text
    stop = greedy[5:7]  # a string the greedy output is known to contain
    r = c.completions.create(temperature=0, stop=[stop], **base)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == greedy[:greedy.index(stop)]
    a = c.completions.create(temperature=1.0, seed=1234, **base).choices[0].text
    b = c.completions.create(temperature=1.0, seed=1234, **base).choices[0].text
    assert a == b


def test_models_health_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    served.client().completions.create(model=served.model, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(served.url + "/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["compress_time_to_first_token_seconds_count"]) >= 1
    assert float(samples["compress_generation_tokens_total"]) >= 3
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "spec_decode_acceptance_ratio"):
        assert f"compress_{gauge}" in samples


def test_auth_errors(served):
    with pytest.raises(openai.AuthenticationError):
        served.client(key="wrong").completions.create(model=served.model, prompt="x", max_tokens=2)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x"})  # no header at all
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(served.url + "/health").status_code == 200  # health and metrics stay open


def test_request_errors_name_the_problem(served):
    c, h = served.client(), {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)):
        c.completions.create(model=served.model, prompt="y" * (MAX_MODEL_LEN + 10), max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        c.completions.create(model=served.model, prompt="x", max_tokens=2, temperature="hot")
    with pytest.raises(openai.UnprocessableEntityError, match="max_tokens"):
        c.completions.create(model=served.model, prompt="x", max_tokens=0)
    with pytest.raises(openai.UnprocessableEntityError, match="messages"):
        c.chat.completions.create(model=served.model, messages=[])
    with pytest.raises(openai.NotFoundError, match="not served"):
        c.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    r = httpx.post(served.url + "/v1/completions", content=b'{"prompt": "x",', headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "n": 99}, headers=h)
    assert r.status_code == 422 and "n:" in r.json()["error"]["message"]
    assert wait_until(lambda: blocks_free(served.engine))


def test_unknown_fields_are_refused_not_dropped(served):
    c = served.client()
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        c.completions.create(model=served.model, prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.weird"):
        c.chat.completions.create(model=served.model, max_tokens=2, messages=[{"role": "user", "content": "x", "weird": 1}])
    # bookkeeping fields every SDK may send are accepted
    r = c.chat.completions.create(model=served.model, max_tokens=2, user="u1", metadata={"k": "v"}, store=False,
                                  messages=[{"role": "user", "content": "x", "name": "ann"}])
    assert r.choices[0].finish_reason in ("stop", "length")


async def _stream(http, url, i, drop: bool) -> tuple[str, str | None, int]:
    """One streaming client; ``drop`` ones hang up after three chunks of a long request."""
    body = {"prompt": f"request {i}: the river", "stream": True, "temperature": 0, "ignore_eos": True,
            "max_tokens": 90 if drop else 12, "stream_options": {"include_usage": True}}
    text, finish, n = [], None, 0
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "".join(text), finish, n
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
            if drop and len(text) >= 3:
                return "dropped", None, -1
    raise AssertionError("stream ended without [DONE]")


def assert_serves_64_streams(served):
    """64 streaming clients at once, every fourth hanging up early: the rest finish, the pool comes back whole."""
    async def main():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_stream(http, served.url + "/v1/completions", i, drop=i % 4 == 0)
                                          for i in range(64)))
    results = asyncio.run(main())
    kept = [r for i, r in enumerate(results) if i % 4]
    assert len(kept) == 48
    assert all(finish == "length" and n == 12 and text for text, finish, n in kept)
    # dropped requests were aborted (never finished) and every block came back
    assert wait_until(lambda: blocks_free(served.engine))
    assert served.app.state.engine_loop.num_pending == 0
    assert served.app.state.metrics.requests.value(finish_reason="length") == 48
    assert served.app.state.metrics.requests.value(finish_reason="abort") == 16


def test_load_64_streaming_clients_some_disconnecting(model_dir):
    served = Served(make_engine(model_dir, max_num_seqs=16), model_name="tiny", max_num_seqs=16, max_queue=64)
    try:
        assert_serves_64_streams(served)
    finally:
        served.close()


def test_transformers_backend_serves_under_load(tmp_path):
    """A family with no native runtime model (GPT-NeoX, run by transformers' modeling code on the engine's paged
    KV cache) behind the server: greedy text equals transformers', and it takes the same load test."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from runtime.models.hf_backend import TransformersLM
    from tiny_engine import hf_greedy as greedy_ids

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=len(tok), max_position_embeddings=256, initializer_range=0.2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    hf = GPTNeoXForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    served = Served(make_engine(tmp_path, max_num_seqs=16), model_name="neox", max_num_seqs=16, max_queue=64)
    try:
        assert isinstance(served.engine.runner.model, TransformersLM)
        assert_serves_64_streams(served)
        prompt = "The river left the mountains"
        r = served.client().completions.create(model="neox", prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert r.choices[0].text == tok.decode(greedy_ids(hf, tok(prompt)["input_ids"], 12), skip_special_tokens=True)
        assert served.app.state.metrics.requests.value(finish_reason="length") == 48 + 1
    finally:
        served.close()


def test_queue_full_is_429(model_dir):
    served = Served(make_engine(model_dir, max_num_seqs=1), model_name="tiny", max_num_seqs=1, max_queue=1)
    try:
        body = {"prompt": "long one", "stream": True, "ignore_eos": True, "max_tokens": MAX_MODEL_LEN - 20}
        with httpx.Client(timeout=60) as h1, httpx.Client(timeout=60) as h2:
            with h1.stream("POST", served.url + "/v1/completions", json=body) as r1, \
                    h2.stream("POST", served.url + "/v1/completions", json=body) as r2:
                assert r1.status_code == 200 and r2.status_code == 200
                with pytest.raises(openai.RateLimitError, match="limit 2"):
                    served.client().completions.create(model="tiny", prompt="x", max_tokens=2)
        # both streams were closed mid-way: their requests are aborted and the pool is whole again
        assert wait_until(lambda: blocks_free(served.engine))
    finally:
        served.close()
