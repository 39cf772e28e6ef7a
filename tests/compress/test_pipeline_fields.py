"""No config field is silently ignored: for each method and each field it reads, on a dense and on a
mixture-of-experts model (its experts compared alone), changing the field changes what the method writes.
A field a method does not read is declared below with the reason, or is refused with a ValueError; a field
added to compress/config.py and declared nowhere fails ``test_every_field_is_declared``."""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib

import pytest
import torch
from tiny_models import tiny_model

from compress.config import FIELDS, AWQOptions, GPTQOptions, QATOptions, QuantizeConfig
from compress.pipeline import METHODS, quantize_model


def _names(t) -> set[str]:
    return {f.name for f in dataclasses.fields(t)}


GPTQ = _names(GPTQOptions) - {"block_size"}
AWQ = _names(AWQOptions) - {"coarse", "search_dtype"}
QAT = _names(QATOptions)
SCHEME = {"bits", "group_size", "sym", "ignore"}
FALLBACK = {"fallback", "holdout"}  # the windows held out to judge the calibrated result against RTN's

# the fields each method reads itself (the pipeline-level steps' fields are tested below)
READS = {
    "rtn": SCHEME,
    "nf4": SCHEME - {"bits", "sym"},
    "gptq": SCHEME | {"calib_dtype", "weighted_range"} | GPTQ | FALLBACK,
    "awq": SCHEME | {"calib_dtype", "weighted_range", "seed"} | AWQ | GPTQ - {"sequential", "refit"} | FALLBACK,
    "qat": SCHEME | {"seed", "batch_size", "train_dtype"} | QAT
           | {"calib_dtype", "weighted_range"} | AWQ - {"rounding"},  # the awq options under init: awq
}
# a MoE model's experts read the same (qat refuses MoE models), and how many routed tokens calibrate one
# (guided GPTQ weights the dense linears' tokens only: the experts are compared alone here, so it is not listed;
# sequential: false is refused on a MoE model, tests/compress/methods/test_gptq_fp.py)
# the experts are not judged against RTN: they fit on every calibration window, held out or not
MOE_READS = {m: READS[m] - {"guided", "guided_mix", "guided_nsamples", "sequential", "refit"} - FALLBACK
              - {"observe_tokens"}  # an expert's search runs on its own routed tokens
             | ({"moe_min_tokens"} if m in ("gptq", "awq") else set()) for m in ("rtn", "nf4", "gptq", "awq")}
# the settings under which a field matters
CONTEXT = {**{("awq", f): {"rounding": "gptq"} for f in GPTQ},
           ("gptq", "guided_mix"): {"guided": True}, ("awq", "guided_mix"): {"rounding": "gptq", "guided": True},
           ("gptq", "guided_nsamples"): {"guided": True, "guided_mix": 0.5},
           ("gptq", "mse_coarse"): {"mse": True}, ("awq", "mse_coarse"): {"rounding": "gptq", "mse": True},
           ("awq", "guided_nsamples"): {"rounding": "gptq", "guided": True, "guided_mix": 0.5},
           **{("qat", f): {"init": "awq"} for f in AWQ | {"calib_dtype", "weighted_range"}},
           ("qat", "learn_zero"): {"steps": 4, "scale_lr": 0.9},
           ("gptq", "holdout"): {"fallback": True}, ("gptq", "refit"): {"fallback": True},
           **{(m, "search_dtype"): {"grid": 20, "search_tokens": 64} for m in ("awq", "qat")}, ("awq", "holdout"): {"fallback": True, "group_size": 16}}  # AWQ keeps some groups  # zeros move only where codes clamp
# read before any method (rotation, KV-head conversion and its uptraining), by compress/pipeline.py
PIPELINE = {"rotate", "kv_heads", "kv_init", "kv_fit_steps", "kv_fit_lr", "uptrain_steps", "uptrain_lr",
            "uptrain_scope"}
# read by no method
UNREAD = {
    "method": "it picks the method",
    "description": "metadata",
    "calib": "compress/job.py turns calib, nsamples and seqlen into the batches quantize_model is given",
    "nsamples": "compress/job.py", "seqlen": "compress/job.py",
    "block_size": "GPTQ's lazy-update width: the same result, faster",
    "coarse": "AWQ's search order: the same choice wherever the loss is unimodal, faster "
              "(tests/compress/methods/common/test_grid.py)",
    "search_dtype": "AWQ's search arithmetic: on these tiny models bf16's rounding is far below the grid points' loss "
                    "differences, so the choices do not move (on SmolLM2 they did: docs/experiments/"
                    "2026-12-06-awq-time-per-block.md)",
    **{f: "compress/job.py rounds the embedding and head after the method (tests/compress/methods/test_embed_head.py)"
       for f in ("embed", "head", "embed_group_size", "head_group_size", "embed_sym", "head_sym")},
    "head_method": "compress/job.py calibrates an untied head after the method "
                   "(tests/compress/methods/test_head_gptq.py)",
}
REFUSED = "refused with a ValueError"
DATA_FREE, PTQ = ("rtn", "nf4"), ("rtn", "nf4", "gptq", "awq")
NOT_READ = {  # field -> {method: why it does not apply, or REFUSED}
    "bits": {"nf4": REFUSED}, "sym": {"nf4": "NF4 is a symmetric codebook"},
    "seed": {m: "nothing is sampled (rotations read it: pipeline-level)" for m in ("rtn", "nf4", "gptq")},
    "batch_size": {m: "compress/job.py splits the batches by it; only training reads it" for m in PTQ},
    "train_dtype": {m: "only training reads it (qat, and GQA uptraining: pipeline-level)" for m in PTQ},
    "calib_dtype": {m: "data-free: no block forwards" for m in DATA_FREE},
    "weighted_range": {m: REFUSED for m in DATA_FREE},
    **{f: {m: "GPTQ's rounding only" for m in (*DATA_FREE, "qat")} for f in ("damp", "damp_of")},
    **{f: {m: REFUSED for m in (*DATA_FREE, "qat")} for f in GPTQ - {"damp", "damp_of", "sequential"}},
    "sequential": {m: REFUSED for m in (*DATA_FREE, "qat", "awq")},
    "refit": {m: REFUSED for m in (*DATA_FREE, "qat", "awq")},
    **{f: {m: "AWQ's searches only" for m in ("rtn", "nf4", "gptq")} for f in AWQ - {"rounding"}},
    "rounding": {m: REFUSED for m in ("rtn", "nf4", "gptq", "qat")},
    **{f: {m: "QAT only" for m in PTQ} for f in QAT},
    # read through the scheme by compress/format/quant.py (and qat's learned zeros), but it changes only groups that
    # min/max rounding gives zero 0, which these random models lack: tests/compress/format/test_quant.py tests it
    "zero_floor": {**{m: "changes no group of these random models" for m in ("rtn", "gptq", "awq", "qat")},
                   "nf4": REFUSED},
    **{f: {m: "nothing calibrated to judge against RTN (qat's init fits on every window)" for m in ("rtn", "nf4", "qat")}
       for f in FALLBACK},
    "moe_min_tokens": {**{m: "refused on a dense model; data-free experts count no tokens" for m in DATA_FREE},
                       **{m: "refused on a dense model (methods/common/moe.py)" for m in ("gptq", "awq", "qat")}},
}
CHANGE = {
    "bits": 3, "group_size": 16, "sym": True, "seed": 1, "batch_size": 4, "calib_dtype": "bfloat16",
    "damp": 0.5, "damp_of": "median", "act_order": True, "static_groups": True, "mse": True, "mse_coarse": 4, "bf16_gram": True,
    "guided": True, "guided_mix": 0.5, "cd_passes": 2,
    "guided_nsamples": 2,
    "sequential": False,
    "weighted_range": True,
    "grid": 3, "duo_scaling": False, "clip": False, "search_tokens": 8, "clip_tokens": 4, "clip_grid": 4,
    "rounding": "gptq", "init": "awq", "steps": 3, "lr": 1e-2, "scale_lr": 0.0, "learn_zero": True, "lr_in_steps": True,
    "self_data": 0.5, "fallback": True, "holdout": 0.25, "refit": True, "observe_tokens": 16,
    "train_dtype": "bfloat16", "ignore": ("lm_head", "o_proj"), "moe_min_tokens": 10_000, "zero_floor": 1,
}
# a MoE model's other linears stay fp, so its experts see the same routed tokens whatever the dense path does
MOE_FP = ("lm_head", r"self_attn\.", "shared_expert")
MOE_CHANGE = {"ignore": (*MOE_FP, r"mlp\.experts$")}
# small searches: fast; no fallback (on 16-token random windows RTN wins nearly everywhere: it would hide the
# method's own fields), which a test of its own turns on
BASE = {"bits": 4, "group_size": 32, "search_tokens": 16, "grid": 5, "clip_grid": 5, "fallback": False}
METHOD_BASE = {"qat": {"steps": 2, "lr": 1e-3, "scale_lr": 0.4, "batch_size": 2, "train_dtype": "float32"}}
KIND_BASE = {"dense": {}, "moe": {"moe_min_tokens": 8, "ignore": MOE_FP}}
# fields that need more than one block to matter (one block's inputs are the embeddings whatever the order)
LAYERS = {"sequential": 2}


@functools.cache
def _model(kind: str, layers: int = 1):
    model = tiny_model("llama" if kind == "dense" else "qwen2_moe", layers=layers)
    with torch.no_grad():  # a router that prefers some experts
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


BATCHES = list(torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0)).split(4))
_cache: dict = {}


def _digest(kind: str, fields: dict, layers: int = 1) -> str:
    """Hash of what quantizing with ``fields`` writes (a MoE model: its experts alone)."""
    key = (kind, layers, tuple(sorted(fields.items())))
    if key not in _cache:
        model = copy.deepcopy(_model(kind, layers))
        quantize_model(model, QuantizeConfig.from_flat(**fields), BATCHES)
        h = hashlib.sha256()
        for k, t in sorted(model.state_dict().items()):
            if kind == "dense" or "experts" in k:
                h.update(k.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        _cache[key] = h.hexdigest()
    return _cache[key]


def _cases():
    for kind, reads in (("dense", READS), ("moe", MOE_READS)):
        for method in reads:
            for field in sorted(reads[method]):
                yield pytest.param(kind, method, field, id=f"{kind}-{method}-{field}")


@pytest.mark.parametrize("kind, method, field", _cases())
def test_a_field_the_method_reads_changes_its_result(kind, method, field):
    base = {**BASE, **METHOD_BASE.get(method, {}), **KIND_BASE[kind], "method": method,
            **CONTEXT.get((method, field), {})}
    value = (MOE_CHANGE if kind == "moe" else {}).get(field, CHANGE[field])
    assert base.get(field) != value
    layers = LAYERS.get(field, 1)
    assert _digest(kind, {**base, field: value}, layers) != _digest(kind, base, layers), f"{method} ignores {field} ({kind})"


GQA = {"method": "rtn", "bits": 8, "group_size": 32, "kv_heads": 1, "kv_init": "mean"}
UPTRAIN = {**GQA, "uptrain_steps": 1, "batch_size": 2, "train_dtype": "float32"}


@pytest.mark.parametrize("kind, base, field, value", [
    ("dense", {**BASE, "method": "rtn"}, "rotate", "hadamard"),
    ("moe", {**BASE, "method": "rtn"}, "rotate", "hadamard"),
    ("dense", {**GQA, "kv_heads": 0}, "kv_heads", 1),
    ("dense", GQA, "kv_init", "pca"),
    ("dense", GQA, "kv_fit_steps", 2),
    ("dense", {**GQA, "kv_fit_steps": 2}, "kv_fit_lr", 0.1),
    ("dense", UPTRAIN, "uptrain_steps", 2),
    ("dense", UPTRAIN, "uptrain_lr", 1e-2),
    ("dense", UPTRAIN, "uptrain_scope", "attn"),
    ("dense", UPTRAIN, "train_dtype", "bfloat16"),
    ("dense", UPTRAIN, "batch_size", 4),
    ("dense", UPTRAIN, "seed", 1),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_pipeline_level_field_changes_the_result(kind, base, field, value):
    assert _digest(kind, {**base, field: value}) != _digest(kind, base), f"the pipeline ignores {field} ({kind})"


def test_every_field_is_declared():
    assert set(READS) == set(METHODS)
    for method in METHODS:
        for field in FIELDS - PIPELINE - set(UNREAD):
            reads, skipped = field in READS[method], method in NOT_READ.get(field, {})
            assert reads != skipped, f"{field} for {method}: declare it read (READS) or not (NOT_READ), once"
    for method, reads in MOE_READS.items():
        assert reads - READS[method] <= {"moe_min_tokens"}, "a MoE model reads what a dense one does"


@pytest.mark.parametrize("method, field", sorted((m, f) for f, why in NOT_READ.items() for m, w in why.items()
                                                 if w == REFUSED))
def test_a_field_the_method_cannot_honour_is_refused(method, field):
    with pytest.raises(ValueError, match=field):
        cfg = QuantizeConfig.from_flat(**{**BASE, "method": method, field: CHANGE[field]})
        quantize_model(copy.deepcopy(_model("dense")), cfg, BATCHES)


def test_moe_min_tokens_is_refused_on_a_dense_model():
    with pytest.raises(ValueError, match="moe_min_tokens"):
        quantize_model(copy.deepcopy(_model("dense")), QuantizeConfig.from_flat(**BASE, moe_min_tokens=8), BATCHES)
