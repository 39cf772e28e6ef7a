import numpy as np
import pytest
import torch

from eval.perplexity import perplexity, token_windows
from eval.tradeoff.kl import summarize, token_kl
from eval.tradeoff.quality import score_windows


def direct_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> np.ndarray:
    """The definition, written out: softmax both, sum p * log(p / q) per position (numpy, float64)."""
    p = np.exp(ref_logits.double().numpy())
    p /= p.sum(-1, keepdims=True)
    q = np.exp(logits.double().numpy())
    q /= q.sum(-1, keepdims=True)
    return (p * np.log(p / q)).sum(-1).reshape(-1)


def test_token_kl_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 37, 300, generator=g) * 3
    other = ref + torch.randn(3, 37, 300, generator=g) * 0.3
    got = token_kl(ref, other, chunk=16).numpy()  # chunks that do not divide the positions
    want = direct_kl(ref, other)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    stats = summarize(torch.from_numpy(got))
    assert stats.mean == pytest.approx(want.mean(), rel=1e-6)
    assert stats.p99 == pytest.approx(np.percentile(want, 99), rel=1e-6)
    assert stats.tokens == 3 * 37


def test_kl_of_a_model_to_itself_is_zero_and_shapes_must_agree():
    x = torch.randn(2, 5, 50)
    assert token_kl(x, x).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="same vocabulary"):
        token_kl(x, torch.randn(2, 5, 49))


def test_score_windows_kl_and_nll_against_a_direct_computation(make_lm, char_tokenizer, text_file):
    ref, model = make_lm("llama", seed=0), make_lm("llama", seed=0)
    with torch.no_grad():  # the variant: the reference with perturbed weights
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    texts = [text_file.read_text()]
    windows = token_windows(char_tokenizer, texts, seqlen=48, max_windows=5)
    nll, kls = score_windows(model, windows, batch_size=2, reference=ref)
    with torch.no_grad():  # the reference computation: both models' logits on the same windows, all at once
        want = direct_kl(ref(input_ids=windows).logits[:, :-1], model(input_ids=windows).logits[:, :-1])
    assert kls.shape == (5 * 47,)
    stats = summarize(kls)
    assert stats.mean == pytest.approx(want.mean(), rel=1e-6)
    assert stats.p99 == pytest.approx(np.percentile(want, 99), rel=1e-6)
    assert stats.mean > 0
    # the NLL is perplexity()'s, on the same windows
    assert nll == pytest.approx(perplexity(model, char_tokenizer, texts, 48, 5, batch_size=2).nll, rel=1e-12)
