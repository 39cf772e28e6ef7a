"""Fixtures for the evaluation tests: tiny random causal LMs and tokenizers, all offline."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class CharTokenizer:
    """Bytes as tokens (vocab 256): enough for perplexity, which only needs ``tokenizer(text)["input_ids"]``."""

    vocab_size = 256

    def __call__(self, text, **_):
        return {"input_ids": list(text.encode("utf-8"))}


def tiny_lm(family: str = "llama", vocab: int = 256, seed: int = 0, tie: bool = False):
    """A tiny random causal LM of ``family`` in eval mode."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=tie)
    cfg = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[family](**common)
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def quantize_rtn(model, bits: int = 4, group_size: int = 32):
    """Swap every decoder linear for a 4-bit RTN QuantLinear (in place) and return the model."""
    from compress.format.checkpoint import set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme, quantize_weight

    scheme = Scheme(bits=bits, group_size=group_size)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}":
            set_module(model, name, QuantLinear.from_quantized(quantize_weight(m.weight.data, scheme), m.bias))
    return model


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2 tokenizer (vocab 49152), read from the embedded GGUF once per session."""
    from compress.format.models import load_tokenizer, resolve

    try:
        return load_tokenizer(resolve("smollm2-135m"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A local .txt source: 40 paragraphs of varied English-like text."""
    words = ("the model reads a long story about rivers and mountains while the old library keeps "
             "quiet records of every season and every traveller who crossed the northern pass").split()
    g = torch.Generator().manual_seed(1)
    paras = [" ".join(words[i] for i in torch.randint(0, len(words), (60,), generator=g).tolist()) + "."
             for _ in range(40)]
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text("\n\n".join(paras))
    return path


@pytest.fixture(scope="session")
def make_lm():
    """Factory fixture: ``make_lm(family, vocab, seed, tie)`` -> a tiny random causal LM."""
    return tiny_lm


@pytest.fixture(scope="session")
def rtn():
    """Factory fixture: ``rtn(model)`` swaps the decoder linears for 4-bit QuantLinear modules."""
    return quantize_rtn
