"""Streaming quantization writes the very tensors the in-memory path writes, holding one block at a time."""
from pathlib import Path

import pytest
import torch

from compress.config import load_recipe
from compress.format.shards import INDEX
from compress.job import quantize_to_folder
from folders import folder_tensors, save_tiny, streamed_and_in_memory
from peak import reset_peak
from tiny_models import tiny_model


# sequential: false (gptq on the fp model's activations) is block by block as well: it streams
@pytest.mark.parametrize("family,recipe,extra", [("llama", "rtn4", {}), ("qwen2", "gptq4", {}), ("gemma", "awq4", {}),
                                                 ("mixtral", "gptq4", {}), ("llama", "gptq4", {"sequential": False})])
def test_streamed_equals_in_memory(tmp_path, smol_tokenizer, calib_text, family, recipe, extra):
    src = save_tiny(tmp_path, family, smol_tokenizer)
    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=4, seqlen=32, batch_size=2, **extra)
    streamed, _ = streamed_and_in_memory(src, cfg, tmp_path)
    assert sorted(p.name for p in Path(streamed.out).glob("*.safetensors")) == ["model.safetensors"]


def test_a_family_whose_head_is_renamed_on_load_streams(tmp_path, smol_tokenizer):
    """GPT-NeoX stores its head as embed_out, which transformers loads as lm_head: no family table entry needed."""
    import transformers as tf

    cfg = tf.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=len(smol_tokenizer), tie_word_embeddings=False)
    src = tmp_path / "neox"
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
    smol_tokenizer.save_pretrained(src)
    streamed = quantize_to_folder(str(src), load_recipe("rtn4"), str(tmp_path / "s"), stream=True)
    whole = quantize_to_folder(str(src), load_recipe("rtn4"), str(tmp_path / "m"), stream=False)
    a, b = folder_tensors(streamed.out), folder_tensors(whole.out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_large_outputs_are_sharded(tmp_path, smol_tokenizer, monkeypatch):
    from compress import stream

    monkeypatch.setattr(stream, "MAX_SHARD_BYTES", 1 << 20)
    src = save_tiny(tmp_path, "llama", smol_tokenizer, layers=3)
    res = quantize_to_folder(str(src), load_recipe("rtn4"), str(tmp_path / "s"), stream=True)
    files = sorted(p.name for p in Path(res.out).glob("*.safetensors"))
    assert (Path(res.out) / INDEX).is_file() and len(files) > 1 and files[0].startswith("model-00001-of-")
    whole = quantize_to_folder(str(src), load_recipe("rtn4"), str(tmp_path / "m"), stream=False)
    assert folder_tensors(res.out).keys() == folder_tensors(whole.out).keys()


def test_outer_tensors_keep_the_source_dtype(tmp_path, smol_tokenizer, calib_text):
    """A bf16 source: embeddings, head and final norm stay bf16 on both paths (the blocks are quantized in fp32)."""
    src = tmp_path / "bf16"
    tiny_model("llama", vocab=len(smol_tokenizer)).to(torch.bfloat16).save_pretrained(src)
    smol_tokenizer.save_pretrained(src)
    cfg = load_recipe("gptq4").replace(calib=str(calib_text), nsamples=4, seqlen=32, batch_size=2, embed="none",
                                       head="none")
    a = folder_tensors(quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True).out)
    b = folder_tensors(quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False).out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert {a[k].dtype for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")} == {torch.bfloat16}
    assert a["model.layers.0.input_layernorm.weight"].dtype == torch.float32


def test_streamed_checkpoint_reloads_to_the_same_logits(tmp_path, smol_tokenizer):
    from compress.format.checkpoint import load_quantized

    src = save_tiny(tmp_path, "llama", smol_tokenizer)
    cfg = load_recipe("rtn4")
    a = load_quantized(quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True).out)
    b = load_quantized(quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False).out)
    ids = torch.randint(0, len(smol_tokenizer), (1, 12))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_streaming_holds_one_block(tmp_path, smol_tokenizer):
    """Blocks of 36 MB (fp32) in a 290 MB model: streaming rtn grows the resident set by one block and the
    rounding's temporaries (about 4 blocks here, whatever the depth), loading the whole model by all 8 and more."""
    from compress.job import peak_rss

    cfg = load_recipe("rtn4")
    warm = save_tiny(tmp_path / "warm", "llama", smol_tokenizer)  # first-use imports are not the model's memory
    quantize_to_folder(str(warm), cfg, str(tmp_path / "w"), stream=True)
    src = save_tiny(tmp_path, "llama", smol_tokenizer, hidden=1024, layers=8, vocab=256)
    block = sum(p.numel() for p in tiny_model("llama", hidden=1024, layers=1, vocab=256).model.layers.parameters()) * 4
    if (before := reset_peak()) is None:
        pytest.skip("needs /proc/self/clear_refs to measure the peak")
    res = quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True)
    streamed = peak_rss() - before
    assert res.memory["largest_block_bytes"] == block
    before = reset_peak()
    quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False)
    whole = peak_rss() - before
    assert streamed < 6 * block < whole, (streamed / 2**20, whole / 2**20, block / 2**20)


def test_max_memory_refuses_before_any_work(tmp_path, smol_tokenizer):
    src = save_tiny(tmp_path, "llama", smol_tokenizer)
    with pytest.raises(MemoryError, match="--max-memory"):
        quantize_to_folder(str(src), load_recipe("gptq4"), str(tmp_path / "o"), max_memory=1 << 20)
    assert not (tmp_path / "o").exists()


def test_killed_run_leaves_no_output(tmp_path, smol_tokenizer, monkeypatch):
    from compress import stream

    src = save_tiny(tmp_path, "llama", smol_tokenizer)

    def boom(self, i, block):
        raise KeyboardInterrupt

    monkeypatch.setattr(stream.StreamedBlocks, "release", boom)
    with pytest.raises(KeyboardInterrupt):
        quantize_to_folder(str(src), load_recipe("rtn4"), str(tmp_path / "o"), stream=True)
    assert list(tmp_path.glob("o*")) == [] and list(tmp_path.glob(".o.tmp-*")) == []


def test_stream_refuses_what_needs_the_whole_model(tmp_path, smol_tokenizer):
    src = save_tiny(tmp_path, "llama", smol_tokenizer)
    with pytest.raises(ValueError, match="trains the whole model"):
        quantize_to_folder(str(src), load_recipe("qat4"), str(tmp_path / "o"), stream=True)


@pytest.mark.parametrize("recipe", ["gptq4", "awq4", "awq-gptq4"])
def test_pad_id_at_the_vocabulary_end_streams(tmp_path, smol_tokenizer, calib_text, recipe):
    """Real configs put the pad id in the vocabulary's last rows (Qwen2: 151,643 of 151,936); the streamed capture
    looks up only the rows the calibration tokens use, so the embedding's padding_idx must not outlive that swap."""
    from transformers import AutoModelForCausalLM

    from tiny_models import tiny_config

    config = tiny_config("qwen2", vocab=len(smol_tokenizer))
    config.pad_token_id = len(smol_tokenizer) - 1
    torch.manual_seed(0)
    src = tmp_path / "qwen2"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(src)
    smol_tokenizer.save_pretrained(src)
    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=4, seqlen=32, batch_size=2)
    streamed = quantize_to_folder(str(src), cfg, str(tmp_path / "s"), stream=True)
    whole = quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=False)
    a, b = folder_tensors(streamed.out), folder_tensors(whole.out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
