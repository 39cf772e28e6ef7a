"""The helpers of scripts/bench/gguf_vs_llamacpp.py that need no llama.cpp build: llama-perplexity's output,
the second-half perplexity protocol, and reading a GGUF's main type."""
import importlib.util
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "gguf_vs_llamacpp.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gguf_vs_llamacpp", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llama_perplexity_final_estimate_is_parsed(tmp_path):
    exe = tmp_path / "llama-perplexity"
    exe.write_text("#!/bin/sh\necho '[1]12.9,[2]13.1,' >&2\necho 'Final estimate: PPL = 13.0512 +/- 0.41253' >&2\n")
    exe.chmod(0o755)
    assert _bench().llama_ppl(tmp_path, Path("m.gguf"), Path("t.txt"), 512, 4, 2) == 13.0512


def _tiny_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0]).save_pretrained(folder)
    return folder


def test_second_half_perplexity_scores_what_llama_perplexity_scores(tmp_path):
    from compress.format.models import load_model

    folder = _tiny_folder(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("some held-out words, " * 20)
    got = _bench().second_half_ppl(folder, text, ctx=16, chunks=3)
    model, tok, _ = load_model(str(folder))
    ids = torch.tensor(tok(text.read_text()).input_ids[:48]).view(3, 16)
    nll, n = 0.0, 0
    with torch.no_grad():
        logp = model(input_ids=ids).logits.log_softmax(-1)
    for w in range(3):
        for i in range(8, 15):  # llama-perplexity: first = n_ctx / 2, logits i score token i + 1, i < n_ctx - 1
            nll -= logp[w, i, ids[w, i + 1]].item()
            n += 1
    assert math.isclose(got, math.exp(nll / n), rel_tol=1e-5)


def test_main_type_reads_the_file_type(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(3)
    w.add_tensor("t", torch.zeros(4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _bench().main_type(path) == "Q4_1"
