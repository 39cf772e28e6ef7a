import pytest
import torch

from eval.task_data import load_docs
from eval.tasks import run_tasks


def _loglik(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | context), split into tokens the way lm-eval does (encode whole, cut at the context)."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(input_ids=ids[:, :-1]).logits.log_softmax(-1)[0, -len(cont):]
    return logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()


def test_piqa_through_lm_eval_matches_a_direct_computation(make_lm, smol_tokenizer):
    model = make_lm("llama", vocab=len(smol_tokenizer), seed=0)  # acc 3/8, acc_norm 4/8: a label swap would show
    result = run_tasks(model, smol_tokenizer, ["piqa", "winogrande"], limit=8, batch_size=4)
    assert set(result) == {"piqa", "winogrande"}
    assert set(result["piqa"]) == {"acc", "acc_norm", "samples"} and set(result["winogrande"]) == {"acc", "samples"}
    assert result["piqa"]["samples"] == result["winogrande"]["samples"] == 8
    acc = acc_norm = 0
    for doc in list(load_docs("piqa"))[:8]:
        choices = [doc["sol1"], doc["sol2"]]
        ll = [_loglik(model, smol_tokenizer, f"Question: {doc['goal']}\nAnswer:", " " + c) for c in choices]
        acc += int(max(range(2), key=lambda i: ll[i]) == doc["label"])
        acc_norm += int(max(range(2), key=lambda i: ll[i] / len(choices[i])) == doc["label"])
    assert result["piqa"]["acc"] == pytest.approx(acc / 8)
    assert result["piqa"]["acc_norm"] == pytest.approx(acc_norm / 8)


def test_quantized_model_is_scored_in_place(make_lm, rtn, smol_tokenizer):
    from compress.format.checkpoint import quantized_modules

    model = rtn(make_lm("llama", vocab=len(smol_tokenizer), tie=True))
    before = {n: m.qweight.clone() for n, m in quantized_modules(model).items()}
    result = run_tasks(model, smol_tokenizer, ["lambada"], limit=2, batch_size=2)
    assert 0.0 <= result["lambada"]["acc"] <= 1.0 and result["lambada"]["perplexity"] > 1.0
    after = quantized_modules(model)
    assert after.keys() == before.keys() and all(torch.equal(after[n].qweight, q) for n, q in before.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, nothing reloaded


def test_unknown_task_and_bad_limit(make_lm, char_tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        run_tasks(make_lm("llama"), char_tokenizer, ["hellaswag", "nope"], limit=2)
    with pytest.raises(ValueError, match="limit=0"):
        run_tasks(make_lm("llama"), char_tokenizer, ["piqa"], limit=0)


def test_model_with_a_quantized_embedding_is_scored(make_lm, smol_tokenizer):
    """HFLM re-ties a given model's embeddings; a tied int8 QuantEmbedding (recipes' `embed: int8`) has no .weight."""
    from compress.format.quant import Scheme
    from compress.methods.embed_head import OuterPlan, quantize_outer

    model = make_lm("llama", vocab=len(smol_tokenizer), tie=True)
    quantize_outer(model, OuterPlan(Scheme(bits=8, group_size=-1), None, True))
    result = run_tasks(model, smol_tokenizer, ["piqa"], limit=2, batch_size=2)
    assert result["piqa"]["samples"] == 2
    assert "tie_weights" not in vars(model)  # the model's own method is back
