"""An exported GGUF loads back through transformers (the path `compress eval FILE.gguf` takes) with the
checkpoint's logits; the SentencePiece vocabulary; a floating-point model exports like llama.cpp's converter."""
from __future__ import annotations

import json

import pytest
import torch

from compress.exporters.dispatch import export
from compress.exporters.gguf import GGUFOptions
from compress.format.checkpoint import load_quantized
from compress.format.models import load_model
from compress.format.quant import Scheme

from .gguf_models import build

gguf = pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))  # load_model caches dequantized GGUFs


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# transformers reads llama and qwen2 GGUFs (not gemma; its qwen3 config ignores key_length, so only Qwen3's default
# head_dim of 128 loads; its qwen2moe/qwen3moe configs omit the expert widths): llama.cpp itself checks the rest
@pytest.mark.parametrize("family,sym", [("llama", True), ("llama", False), ("qwen2", True)])
def test_transformers_loads_the_gguf_with_the_checkpoints_logits(tmp_path, family, sym):
    src = build(tmp_path / "q", family, Scheme(4, 32, sym))
    path = export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    model, tokenizer, _ = load_model(str(path))
    ids = torch.randint(0, 290, (2, 16), generator=torch.Generator().manual_seed(0))
    want = _logits(load_quantized(src), ids)
    # Q4_0 is bit-identical; Q4_1 differs by the fp16 rounding of each block's minimum
    torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=1e-5 if sym else 5e-2)
    src_tok = load_model(str(src))[1]
    text = "the quick brown fox, hello world 123"
    assert tokenizer(text).input_ids == src_tok(text).input_ids


def test_floating_point_model_exports_like_llama_cpps_converter(tmp_path):
    from .gguf_models import _dense, bpe_tokenizer

    model = _dense("llama")
    model.save_pretrained(tmp_path / "fp")
    bpe_tokenizer().save_pretrained(tmp_path / "fp")
    path = export(str(tmp_path / "fp"), "gguf", tmp_path / "fp.gguf")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert reader.fields["general.file_type"].contents() == 1 and reader.fields["compress.quant_method"].contents() == "none"
    back, _, _ = load_model(str(path))
    ids = torch.arange(20)[None]
    torch.testing.assert_close(_logits(back, ids), _logits(model, ids), rtol=0, atol=2e-2)


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: BPE over '▁'-prefixed pieces with <0xNN> byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "h", "i", "▁h", "▁hi"]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_vocabulary():
    from compress.exporters.gguf_vocab import BYTE, CONTROL, NORMAL, UNKNOWN, vocab_of

    tok = sentencepiece_tokenizer()
    v = vocab_of(tok, 270).values()
    assert v["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in v
    assert v["tokenizer.ggml.add_space_prefix"] is True
    types = v["tokenizer.ggml.token_type"]
    assert types[0] == UNKNOWN and types[3] == BYTE and types[3 + 255] == BYTE and types[259] == NORMAL
    assert types[1] == CONTROL and v["tokenizer.ggml.bos_token_id"] == 1
    scores = v["tokenizer.ggml.scores"]
    assert scores[262] > scores[263]  # "▁h" (lower id) merges before "▁hi"
    assert v["tokenizer.ggml.tokens"][269] == "[PAD269]"


def test_compress_eval_scores_the_gguf_as_it_scores_the_checkpoint(tmp_path):
    from click.testing import CliRunner

    from cli import main

    src = build(tmp_path / "q", "llama", Scheme(4, 32, sym=True))
    path = export(str(src), "gguf", tmp_path / "m.gguf", options=GGUFOptions(embed_type="f32"))
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, hello world. " * 40)
    results = []
    for model in (src, path):
        out = tmp_path / f"{model.name}.json"
        r = CliRunner().invoke(main, ["eval", str(model), "--ppl", str(text), "--seqlen", "32", "--json", str(out)])
        assert r.exit_code == 0, r.output
        results.append(json.loads(out.read_text())["compressed"]["ppl"])
    assert results[0] == pytest.approx(results[1], rel=1e-5) and len(results[0]) == 1
