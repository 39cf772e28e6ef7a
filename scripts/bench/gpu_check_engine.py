"""The engine section of scripts/bench/gpu_check.py: a random Llama made on the spot, rtn4-quantized, served.

The model comes from scripts/make_random_model.py (the 1b shape on a GPU, a 2-block toy in the dry run) with a
byte-level tokenizer built here, so nothing is read from a hub or a package (the SmolLM2 GGUF is 94 MiB, too big
to travel with the tree). It is quantized as ``compress quantize --recipe rtn4 --stream`` does, then runs in the
engine at each batch size through runtime/bench/timing.py's request loop: TTFT and time per output token are
medians over requests, tok/s is output tokens over wall time.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class EnginePlan:
    shape: str | dict  # a scripts/make_random_model.py SHAPES name, or the fields themselves
    layers: int | None  # fewer blocks than the shape has (None: all of them)
    batches: tuple[int, ...]
    prompt_len: int
    output_len: int
    kv_cache_memory: int


GPU_ENGINE = EnginePlan("1b", None, (1, 64), 128, 128, 4 << 30)
DRY_ENGINE = EnginePlan(TINY_SHAPE, 2, (1, 4), 16, 8, 16 << 20)


def byte_tokenizer():
    """A byte-level tokenizer of 256 ids and no merges: every text encodes, every id below 256 decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _make_random_model(root: Path):
    """scripts/make_random_model.py as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location("make_random_model", root / "scripts" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_checkpoint(plan: EnginePlan, root: Path, work: Path) -> dict:
    """Write the random fp model and its rtn4 checkpoint under ``work``; returns paths and timings."""
    from compress import api

    t0 = time.perf_counter()
    fp_dir, q_dir = work / "random-fp", work / "random-rtn4"
    _make_random_model(root).write(fp_dir, plan.shape, plan.layers, tokenizer=byte_tokenizer())
    t1 = time.perf_counter()
    summary = api.quantize(str(fp_dir), "rtn4", str(q_dir), overwrite=True, stream=True)
    t2 = time.perf_counter()
    size = sum(p.stat().st_size for p in q_dir.glob("*.safetensors"))
    return {"fp_dir": str(fp_dir), "checkpoint": str(q_dir), "make_s": round(t1 - t0, 1),
            "quantize_s": round(t2 - t1, 1), "checkpoint_mib": round(size / 2**20, 1),
            "quantize_peak_rss_mib": round(summary.peak_rss_bytes / 2**20)}


def _shape_fields(plan: EnginePlan, root: Path) -> dict:
    return _make_random_model(root).SHAPES[plan.shape] if isinstance(plan.shape, str) else plan.shape


def run_batches(plan: EnginePlan, checkpoint: str, device: str, left: Callable[[], float]) -> dict:
    """Warm up, then each batch size: ``batch`` requests admitted together, each ``output_len`` tokens (no EOS)."""
    from runtime.bench.timing import run_engine, summarize
    from runtime.bench.workload import make_requests
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.sequence import SamplingParams

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=checkpoint, device=device, max_num_seqs=max(plan.batches),
                                 kv_cache_memory=plan.kv_cache_memory,
                                 max_model_len=plan.prompt_len + plan.output_len + 16))
    load_s = time.perf_counter() - t0
    # one untimed pass of the largest batch: Triton compiles each block-size variant the timed passes meet
    top = max(plan.batches)
    run_engine(engine, make_requests(engine.tokenizer, top, plan.prompt_len, plan.output_len, 0.0, seed=1), top, False,
               SamplingParams)
    warm_s = time.perf_counter() - t0 - load_s
    out, skipped = {}, []
    for i, batch in enumerate(plan.batches):
        if i and left() <= 0:  # the first always runs: the model took the time, batch 1 takes seconds
            skipped.append(batch)
            continue
        reqs = make_requests(engine.tokenizer, batch, plan.prompt_len, plan.output_len, 0.0, seed=batch)
        row = summarize("engine", checkpoint, batch, [run_engine(engine, reqs, batch, False, SamplingParams)])
        tpot = row.tpot_ms_p50
        out[str(batch)] = {"requests": row.requests, "ttft_ms_p50": row.ttft_ms_p50, "tpot_ms_p50": tpot,
                           "decode_tok_s_per_seq": None if not tpot else round(1000 / tpot, 1),
                           "output_tok_s": round(row.output_tok_s, 1)}
    return {"load_s": round(load_s, 1), "warmup_s": round(warm_s, 1), "dtype": str(engine.dtype),
            "kernel_paths": engine.runner.kernel_paths, "batches": out, "skipped_for_time": skipped}


def engine_section(plan: EnginePlan, root: Path, work: Path, device: str, left: Callable[[], float]) -> dict:
    fields = _shape_fields(plan, root)
    shape_layers = fields["num_hidden_layers"]
    built = build_checkpoint(plan, root, work)
    res = {"shape": plan.shape if isinstance(plan.shape, str) else "tiny", "layers": plan.layers or shape_layers,
           "shape_layers": shape_layers, "fewer_layers_than_shape": (plan.layers or shape_layers) < shape_layers,
           "hidden_size": fields["hidden_size"], "vocab_size": fields["vocab_size"],
           "prompt_len": plan.prompt_len, "output_len": plan.output_len, "device": device, **built}
    return {**res, **run_batches(plan, built["checkpoint"], device, left)}
