"""Tiny random models of each family the toolkit supports, built in the test (no hub, no downloads)."""
import torch

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # 4 experts, top-2
NUM_EXPERTS = 4


def tiny_config(family: str, hidden: int = 64, vocab: int = 256, layers: int = 2):
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
    """A few loud input channels in every block, as real LLM activations have (what AWQ and rotations are for)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:n] *= factor
            layer.post_attention_layernorm.weight[:n] *= factor
    return model
