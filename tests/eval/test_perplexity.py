import math

import pytest
import torch
from torch import nn

from eval.perplexity import perplexity, window_nll_sum

TEXT = ["Perplexity is the exponential of the mean negative log-likelihood per predicted token. " * 6,
        "A second text follows after a blank line, so the join matters. " * 6]


def _ids(tokenizer):
    return torch.tensor(tokenizer("\n\n".join(TEXT))["input_ids"])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_window_equals_hf_loss(family, make_lm, char_tokenizer):
    model = make_lm(family)
    ids = _ids(char_tokenizer)[:64].unsqueeze(0)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    r = perplexity(model, char_tokenizer, TEXT, seqlen=64, max_windows=1)
    assert r.windows == 1 and r.tokens == 63
    assert r.nll == pytest.approx(loss, rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(loss), rel=1e-5)


def test_windows_are_independent_of_batching(make_lm, char_tokenizer):
    model = make_lm("llama")
    n = _ids(char_tokenizer).numel()
    one = perplexity(model, char_tokenizer, TEXT, seqlen=48, batch_size=1)
    many = perplexity(model, char_tokenizer, TEXT, seqlen=48, batch_size=5)
    assert one.windows == many.windows == n // 48  # the last partial window is dropped
    assert one.tokens == one.windows * 47
    assert one.nll == pytest.approx(many.nll, rel=1e-5)
    assert perplexity(model, char_tokenizer, TEXT, seqlen=48, max_windows=2).windows == 2


class Uniform(nn.Module):
    """Equal logits for every token: perplexity must be exactly the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_uniform_model_has_ppl_vocab(char_tokenizer):
    r = perplexity(Uniform(256), char_tokenizer, TEXT, seqlen=32)
    assert r.ppl == pytest.approx(256, rel=1e-5)  # fp32 log-softmax


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_loss_matches_full_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 20, 50, generator=g)
    ids = torch.randint(0, 50, (3, 20), generator=g)
    full = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="sum")
    assert window_nll_sum(logits, ids, chunk=chunk).item() == pytest.approx(full.item(), rel=1e-6)


def test_quantized_model_scores_like_its_own_loss(make_lm, rtn, char_tokenizer):
    model = rtn(make_lm("llama"))
    ids = _ids(char_tokenizer)[:64].unsqueeze(0)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert perplexity(model, char_tokenizer, TEXT, seqlen=64, max_windows=1).nll == pytest.approx(loss, rel=1e-5)


def test_too_little_text_is_a_clear_error(make_lm, char_tokenizer):
    with pytest.raises(ValueError, match="fewer than one window of seqlen=4096"):
        perplexity(make_lm("llama"), char_tokenizer, ["short"], seqlen=4096)
    with pytest.raises(ValueError, match="seqlen=1"):
        perplexity(make_lm("llama"), char_tokenizer, TEXT, seqlen=1)


@pytest.mark.slow
def test_real_smollm2_held_out_wiki_is_in_the_expected_range():
    from compress.data import load_texts
    from compress.format.models import load_model

    model, tok, _ = load_model("smollm2-135m")
    r = perplexity(model, tok, load_texts("wiki", "eval"), seqlen=512, max_windows=4)
    assert r.windows == 4 and 10 < r.ppl < 40  # the full 64-window protocol gives ~20.9
