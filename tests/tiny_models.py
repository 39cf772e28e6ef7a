"""Tiny random models of each family the toolkit supports, built in the test (no hub, no downloads)."""
import contextlib

import torch

# the dense families: Llama-shaped blocks, then the ones whose blocks differ beyond the table's data (sandwich or
# post norms, soft-capping, fused projections, multipliers), which tests of those features take on their own
LLAMA_LIKE = ("llama", "qwen2", "mistral", "gemma", "qwen3")
BLOCK_VARIANTS = ("gemma2", "gemma3_text", "phi3", "olmo2", "granite")
FAMILIES = LLAMA_LIKE + BLOCK_VARIANTS
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # 4 experts, top-2
NUM_EXPERTS = 4


def tiny_config(family: str, hidden: int = 64, vocab: int = 256, layers: int = 2, tie: bool | None = None):
    """``family``'s tiny config; ``tie`` sets ``tie_word_embeddings`` (None: the family's own default)."""
    config = _config(family, hidden, vocab, layers)
    if tie is not None:
        config.tie_word_embeddings = tie
    return config


def _config(family: str, hidden: int, vocab: int, layers: int):
    import transformers as tf

    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "qwen2":
        return tf.Qwen2Config(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if family == "gemma":
        return tf.GemmaConfig(**common, head_dim=hidden // 4, hidden_act="gelu_pytorch_tanh")
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=hidden // 4)
    if family == "gemma2":  # sliding and global layers alternate; attention and final logits soft-capped
        return tf.Gemma2Config(**common, head_dim=hidden // 4, sliding_window=8, query_pre_attn_scalar=hidden // 4,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if family == "gemma3_text":  # q/k norms, local rope base on sliding layers, 5:1 pattern cut to 2 layers
        return tf.Gemma3TextConfig(**common, head_dim=hidden // 4, sliding_window=8, query_pre_attn_scalar=hidden // 4,
                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                   + ["sliding_attention"] * (layers % 2),
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1_000_000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10_000.0}})
    if family == "phi3":  # fused qkv_proj and gate_up_proj in the checkpoint, partial rotary
        return tf.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "olmo2":  # norms after attention and MLP only, q/k norm over the whole projection
        return tf.Olmo2Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "granite":  # embedding, residual, attention and logit multipliers
        return tf.GraniteConfig(**common, embedding_multiplier=6.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=4.0)
    moe = {**common, "intermediate_size": 3 * hidden // 2, "num_experts_per_tok": 2}
    if family == "mixtral":
        return tf.MixtralConfig(**moe, num_local_experts=NUM_EXPERTS)
    if family == "qwen2_moe":  # with its shared expert (and shared_expert_gate)
        return tf.Qwen2MoeConfig(**moe, num_experts=NUM_EXPERTS, moe_intermediate_size=3 * hidden // 4,
                                 shared_expert_intermediate_size=hidden)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**moe, num_experts=NUM_EXPERTS, moe_intermediate_size=3 * hidden // 4,
                                 head_dim=hidden // 4)
    if family == "olmoe":
        return tf.OlmoeConfig(**moe, num_experts=NUM_EXPERTS)
    raise ValueError(family)


def tiny_model(family: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kw), dtype=torch.float32).eval()
    # random init leaves norms at 1: perturb them so smoothing into norms is exercised for real
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def loud_channels(model, n: int = 4, factor: float = 20.0):
    """A few loud channels in every block, as real LLM activations have (what AWQ and rotations are for): every
    block norm's first ``n`` weights scaled (Llama: the two pre-norms; OLMo 2 has only post-norms)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for name, p in layer.named_parameters():
                if name.endswith("layernorm.weight"):
                    p[:n] *= factor
    return model


def byte_tokenizer():
    """A 256-token byte-level tokenizer made offline (vocab = the 256 bytes, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=sorted(alphabet)[0])


@contextlib.contextmanager
def one_thread():
    """Tiny tensors: one thread is several times faster than a thread pool on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# the bundled recipes at tiny sizes (the path, not the accuracy)
TINY_RECIPE = dict(nsamples=4, seqlen=16, batch_size=2, search_tokens=64, clip_tokens=64, grid=5, clip_grid=10)


def token_batches(n: int = 4, seqlen: int = 16, seed: int = 0, vocab: int = 256) -> list:
    """Random calibration token ids in batches of 2."""
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, vocab, (n, seqlen), generator=g).split(2))


def quantize_tiny(family: str, recipe: str, folder=None, **overrides):
    """(fp model, quantized model): ``family``'s tiny model quantized by the bundled ``recipe`` at tiny sizes
    (compress.pipeline), saved into ``folder`` as `compress quantize` saves it (with a tokenizer) when given."""
    import copy

    from compress.config import load_recipe
    from compress.format.checkpoint import build_quantization_config, save_quantized
    from compress.pipeline import quantize_model

    cfg = load_recipe(recipe).replace(**{**TINY_RECIPE, **overrides})
    base = tiny_model(family)
    model = copy.deepcopy(base)
    quantize_model(model, cfg, token_batches())
    if folder is not None:
        act_order = any(getattr(m, "g_idx", None) is not None for m in model.modules())
        save_quantized(model, byte_tokenizer(), folder, build_quantization_config(model, cfg.method, cfg.scheme, act_order))
    return base, model
