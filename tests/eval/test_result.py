"""`compress eval`'s typed result writes the JSON it wrote as a dict (the same keys, in order), and the old dict keys
still read: ``result["delta"]["ppl"]`` is ``result.delta.ppl``."""
import json

import pytest

from eval.result import Delta, EvalResult, ModelResult, PplResult, Settings

MODEL_KEYS = ["model", "size_bytes", "size_label", "ppl", "ppl_detail", "accuracy", "accuracy_avg", "seconds"]


def _model(name="m", size=1000, label="weight files on disk", tokenizer=None, ppl=20.0, acc=0.5):
    return ModelResult(name, size, label, tokenizer, {"wiki": PplResult(ppl, 3.0, 126, 2)},
                       {"piqa": {"acc": acc, "acc_norm": acc, "samples": 2.0}}, acc, {"load": 1.0})


def _result():
    base, comp = _model("fp", 4000, ppl=20.0, acc=0.5), _model("q", 1000, ppl=21.0, acc=0.25)
    return EvalResult(base, comp, Delta.between(base, comp), Settings(512, 4, 2))


def test_the_json_keeps_the_dicts_keys_in_order():
    out = json.loads(json.dumps(_result().to_json()))
    assert list(out) == ["baseline", "compressed", "delta", "settings"]
    assert list(out["compressed"]) == MODEL_KEYS
    assert out["compressed"]["ppl"] == {"wiki": 21.0}
    assert out["compressed"]["ppl_detail"] == {"wiki": {"ppl": 21.0, "nll": 3.0, "tokens": 126, "windows": 2}}
    assert out["delta"] == {"size_bytes": -3000, "size_ratio": 0.25, "ppl": {"wiki": 1.0},
                            "accuracy": {"piqa": {"acc": -0.25, "acc_norm": -0.25}}, "accuracy_avg": -0.25}
    assert out["settings"] == {"seqlen": 512, "max_windows": 4, "limit": 2, "split": "eval"}


def test_a_served_model_carries_its_tokenizer_and_no_size():
    served = _model("m @ url", None, "served", tokenizer="smollm2-135m")
    out = served.to_json()
    assert list(out) == [*MODEL_KEYS[:3], "tokenizer", *MODEL_KEYS[3:]] and out["size_bytes"] is None
    delta = Delta.between(_model(), served)
    assert delta.size_bytes is None and delta.size_ratio is None
    alone = EvalResult(None, served, None, Settings(512, None, None)).to_json()
    assert alone["baseline"] is None and alone["delta"] is None


def test_the_old_dict_keys_still_read():
    r = _result()
    assert r["delta"] is r.delta and r["delta"]["ppl"] == {"wiki": 1.0}
    assert r["compressed"]["ppl"] == r.compressed.ppl == {"wiki": 21.0}
    assert r["compressed"]["ppl_detail"]["wiki"]["windows"] == 2 and r["settings"]["split"] == "eval"
    with pytest.raises(KeyError):
        r["to_json"]
    with pytest.raises(KeyError):
        r.compressed["nope"]
