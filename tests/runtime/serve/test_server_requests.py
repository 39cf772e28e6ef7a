"""What real clients send, through the `openai` client against the app: n, penalties, logit_bias, logprobs (chat,
completions, echo with prompt logprobs as lm-eval's local-completions asks) checked against the model's logits."""
import httpx
import openai
import pytest
import torch

from test_server import KEY, Served, blocks_free, make_engine, model_dir, wait_until  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def served(model_dir):  # noqa: F811
    s = Served(make_engine(model_dir), model_name=str(model_dir), api_key=KEY, max_num_seqs=8, max_queue=128)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(model_dir)


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_n_choices_and_seeds(served):
    c = served.client()
    kw = dict(model=served.model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=11,
              extra_body={"ignore_eos": True})
    r = c.completions.create(**kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len("Once upon a time")
    assert [ch.text for ch in c.completions.create(**kw).choices] == [ch.text for ch in r.choices]
    chunks = list(c.completions.create(stream=True, **kw))
    streamed = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(3)}
    assert streamed == {ch.index: ch.text for ch in r.choices}
    chat = c.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}], n=2,
                                     max_tokens=4, temperature=1.0, seed=3)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert wait_until(lambda: blocks_free(served.engine))


def test_penalties_and_logit_bias(served, hf):
    model, tok = hf
    c = served.client()
    forced = tok.convert_tokens_to_ids("Q")
    r = c.completions.create(model=served.model, prompt="abc", max_tokens=5, temperature=0,
                             logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "QQQQQ"
    r = c.completions.create(model=served.model, prompt="abc", max_tokens=5, temperature=0, frequency_penalty=2.0,
                             logit_bias={str(forced): 9}, extra_body={"ignore_eos": True, "min_p": 0.1})
    assert r.choices[0].text.count("Q") < 5  # the penalty pushes the biased token down after its first use
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model=served.model, prompt="abc", max_tokens=2, logit_bias={"99999": 1})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  logprobs=True, top_logprobs=21)


def test_chat_logprobs_match_the_model(served, hf):
    model, tok = hf
    c = served.client()
    messages = [{"role": "user", "content": "Name a river."}]
    kw = dict(model=served.model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = c.chat.completions.create(**kw)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    content = r.choices[0].logprobs.content
    gen = tok.convert_tokens_to_ids([e.token for e in content])
    ref = log_softmax(model, ids + gen)
    want = [ref[len(ids) - 1 + i, t].item() for i, t in enumerate(gen)]
    assert [e.logprob for e in content] == pytest.approx(want, abs=1e-4)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_echo_prompt_logprobs_as_lm_eval_sends_them(served, hf):
    """lm-eval's local-completions loglikelihood payload: token ids, max_tokens 1, logprobs 1, echo, temperature 0."""
    model, tok = hf
    ids = tok("The cat sat on the mat")["input_ids"]
    body = {"model": served.model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(served.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    ref = log_softmax(model, ids)
    want = [ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][:3] == [0, 1, 2]  # one character per token in this tokenizer
    # max_tokens 0 with echo: the prompt scored, nothing generated
    r = served.client().completions.create(model=served.model, prompt="The cat", max_tokens=0, echo=True, logprobs=0)
    assert r.choices[0].text == "The cat" and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.token_logprobs) == len("The cat")


def test_lm_eval_local_completions_scores_the_server(served, hf, model_dir):  # noqa: F811
    """lm-eval's own client (its payload, its parsing) gets the model's loglikelihood from the server."""
    lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    model, tok = hf
    lm = lm_eval_api.LocalCompletionsAPI(base_url=served.url + "/v1/completions", model=served.model,
                                         tokenizer_backend="huggingface", tokenizer=str(model_dir), max_retries=1,
                                         header={"Authorization": f"Bearer {KEY}"})
    pairs = [("The river", " ran"), ("A small town", " grew slowly")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                           disable_tqdm=True)
    for (ctx, cont), (ll, _) in zip(pairs, got):
        c, w = tok(ctx)["input_ids"], tok(cont)["input_ids"]
        ref = log_softmax(model, c + w)
        assert ll == pytest.approx(sum(ref[len(c) - 1 + i, t].item() for i, t in enumerate(w)), abs=1e-3)


def test_echo_with_n_scores_the_prompt_for_every_choice(served):
    c = served.client()
    kw = dict(model=served.model, prompt="The cat", max_tokens=3, echo=True, logprobs=1, n=2, temperature=1.0, seed=4)
    r = c.completions.create(**kw)
    first, second = (ch.logprobs for ch in sorted(r.choices, key=lambda ch: ch.index))
    assert first.token_logprobs[:7] == second.token_logprobs[:7] and first.token_logprobs[1] is not None
    chunks = list(c.completions.create(stream=True, **kw))
    for i in (0, 1):
        got = [lp for ch in chunks if ch.choices[0].index == i for lp in ch.choices[0].logprobs.token_logprobs]
        assert got[:7] == first.token_logprobs[:7] and len(got) == 10
