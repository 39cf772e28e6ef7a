"""llama.cpp itself runs our GGUF exports: `llama-perplexity` on a tiny exported model gives the checkpoint's
perplexity (same text, same windows), per family. Skipped without a llama.cpp build (scripts/bench/llamacpp.sh).

The tolerance is loose (2%) because llama.cpp rounds activations to 8 bits for its quantized dot products and
these random models are peaked (perplexity ~1000 over 300 tokens), which amplifies any difference; a missing
q/k row interleave (Llama) or Gemma's missing ``1 + w`` moves the perplexity by 17% and 80%.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from compress.exporters.dispatch import export
from compress.exporters.gguf import GGUFOptions
from compress.format.models import load_model
from compress.format.quant import Scheme

from .gguf_models import build

CTX, CHUNKS = 64, 4


def _llama_perplexity() -> Path | None:
    if os.environ.get("LLAMACPP_BIN"):
        exe = Path(os.environ["LLAMACPP_BIN"]) / "llama-perplexity"
        return exe if exe.is_file() else None
    cache = Path(os.environ.get("COMPRESS_CACHE") or Path.home() / ".cache" / "compress")
    return next(iter(sorted(cache.glob("llama.cpp-*/bin/llama-perplexity"))), None)


EXE = _llama_perplexity()
pytestmark = pytest.mark.skipif(EXE is None, reason="no llama.cpp build: bash scripts/bench/llamacpp.sh")


def _torch_ppl(folder: Path, text: str) -> float:
    """llama-perplexity's protocol: windows of CTX tokens, logits at CTX/2..CTX-2 score the next token."""
    model, tok, _ = load_model(str(folder))
    ids = torch.tensor(tok(text).input_ids)
    n = min(CHUNKS, ids.numel() // CTX)
    windows = ids[: n * CTX].view(n, CTX)
    with torch.no_grad():
        logp = model(input_ids=windows).logits.float().log_softmax(-1)
    first = CTX // 2
    nll = -logp[:, first:CTX - 1].gather(-1, windows[:, first + 1:, None]).sum().item()
    return math.exp(nll / (n * (CTX - 1 - first)))


@pytest.mark.parametrize("family,bits,sym", [
    ("llama", 4, True), ("llama", 4, False), ("llama", 8, True), ("mistral", 4, True), ("qwen2", 4, False), ("qwen3", 4, True),
    ("gemma", 4, True), ("qwen2_moe", 4, True), ("mixtral", 4, False), ("qwen3_moe", 4, True),
    ("granite", 4, True),  # its embedding, residual, attention and logit multipliers as granite.* metadata
    # sandwich norms, soft-capping, sliding layers (their pattern and rope base are a ~0.1% effect here)
    ("gemma2", 4, True), ("gemma3_text", 4, False),
    ("phi3", 4, True), ("olmo2", 4, False),  # fused qkv/gate_up and partial rotary; post-norms and q/k norms
])
def test_llama_perplexity_matches_the_checkpoint(tmp_path, monkeypatch, family, bits, sym):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    src = build(tmp_path / "q", family, Scheme(bits, 32, sym))
    path = export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    text = "the quick brown fox jumps over the lazy dog, hello world. " * 60
    (tmp_path / "t.txt").write_text(text)
    assert _llama_ppl(path, tmp_path / "t.txt") == pytest.approx(_torch_ppl(src, text), rel=0.02)


def _llama_ppl(gguf: Path, text: Path, tries: int = 10) -> float:
    """llama-perplexity's running estimate after chunk CHUNKS: the final estimate of a CHUNKS-chunk run. Its log
    thread loses the last lines of about half of these short runs (exit status 0, output cut after a chunk, seen
    with pipes and files alike, more often on a loaded machine), so it runs one chunk more than it reads and the
    line wanted is not the last one; a run cut before it anyway is repeated (each takes ~50 ms)."""
    for _ in range(tries):
        r = subprocess.run([str(EXE), "-m", str(gguf), "-f", str(text), "-c", str(CTX), "-b", str(CTX),
                            "--chunks", str(CHUNKS + 1), "-t", "1"], capture_output=True, text=True, timeout=120,
                           check=True)
        found = re.search(rf"\[{CHUNKS}\]([0-9.]+),", r.stdout + r.stderr)
        if found:
            return float(found.group(1))
    raise AssertionError(f"no estimate after chunk {CHUNKS} in {tries} runs: {(r.stdout + r.stderr)[-2000:]}")


@pytest.mark.parametrize("sym", [True, False])
def test_llama_cpp_runs_k_quant_exports_as_transformers_reads_them(tmp_path, monkeypatch, sym):
    """Q4_K is not exactly our weights (6-bit scales), so the reference is the file itself, dequantized by
    transformers' GGUF loader."""
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    src = build(tmp_path / "q", "qwen2", Scheme(4, 32, sym), hidden=256)
    path = export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32", k_quants=True))
    text = "the quick brown fox jumps over the lazy dog, hello world. " * 60
    (tmp_path / "t.txt").write_text(text)
    assert _llama_ppl(path, tmp_path / "t.txt") == pytest.approx(_torch_ppl(path, text), rel=0.02)


@pytest.mark.parametrize("rid", ["llama/meta-llama--Llama-3.1-8B-Instruct", "phi3/microsoft--Phi-4-mini-instruct"])
def test_llama_cpp_runs_scaled_rope(tmp_path, monkeypatch, rid):
    """Llama 3.1's llama3 rope (``rope_freqs``) and Phi-4-mini's longrope (``rope_factors_long/short``, attn_factor;
    short factors within the original context, as transformers): llama.cpp loads the factors (it refuses a file
    holding a tensor it does not read) and scores the fp32 export as transformers scores the tiny model."""
    from real_configs import build as build_real
    from real_configs import load_all

    from .gguf_models import bpe_tokenizer

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    build_real(next(r for r in load_all() if r.id == rid), tmp_path / "fp")
    bpe_tokenizer().save_pretrained(tmp_path / "fp")
    path = export(str(tmp_path / "fp"), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    text = "the quick brown fox jumps over the lazy dog, hello world. " * 60
    (tmp_path / "t.txt").write_text(text)
    assert _llama_ppl(path, tmp_path / "t.txt") == pytest.approx(_torch_ppl(tmp_path / "fp", text), rel=0.02)
