"""The engine on the real SmolLM2-135M (slow): greedy parity with transformers, fp and quantized."""
import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.sequence import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)


def hf_greedy(model, tok, prompt: str, n: int = 64) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None
    return model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def smollm2():
    from compress.format.models import load_model

    model, tok, _ = load_model("smollm2-135m")
    return model, tok


def test_greedy_parity_with_transformers(smollm2):
    model, tok = smollm2
    engine = Engine(EngineConfig(model="smollm2-135m"))
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert out.token_ids == hf_greedy(model, tok, prompt)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_prompt_lookup_is_token_identical():
    text = "The quick brown fox jumps over the lazy dog. All that glitters is not gold."
    prompt = f"<|im_start|>user\nRepeat this text exactly:\n{text}<|im_end|>\n<|im_start|>assistant\n"
    plain = Engine(EngineConfig(model="smollm2-135m")).generate([prompt], GREEDY)[0]
    spec = Engine(EngineConfig(model="smollm2-135m", draft="ngram"))
    assert spec.generate([prompt], GREEDY)[0].token_ids == plain.token_ids
    assert spec.stats()["spec_accepted"] > 0


def test_quantized_parity_with_quantlinear(smollm2, tmp_path):
    from compress.format.checkpoint import build_quantization_config, load_quantized, save_quantized, set_module
    from compress.format.qlinear import QuantLinear
    from compress.format.quant import Scheme, quantize_weight

    model, tok = smollm2
    scheme = Scheme(bits=4, group_size=64, sym=False)
    qmodel = type(model)(model.config).eval()
    qmodel.load_state_dict(model.state_dict())
    for name, mod in list(qmodel.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            set_module(qmodel, name, QuantLinear.from_quantized(quantize_weight(mod.weight.data, scheme)))
    save_quantized(qmodel, tok, tmp_path / "q", build_quantization_config(qmodel, "rtn", scheme))
    ref_model = load_quantized(tmp_path / "q")
    for m in ref_model.modules():
        if isinstance(m, QuantLinear):
            m.cache_weight()  # the same dequantized numbers, computed once instead of every forward
    engine = Engine(EngineConfig(model=str(tmp_path / "q"), quant_kernel="dequant", dtype="float32"))
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY)):
        assert out.token_ids == hf_greedy(ref_model, tok, prompt)
    packed = Engine(EngineConfig(model=str(tmp_path / "q"), dtype="bfloat16"))
    (path, count), = packed.runner.kernel_paths.items()
    from runtime.kernels import w8a8
    kernel = "w8a8" if w8a8.available() else "int4pack"  # the int8-activation kernel where the CPU has VNNI
    assert path.startswith(kernel) and count == 4 * model.config.num_hidden_layers, packed.runner.kernel_paths
    assert packed.generate(PROMPTS[:1], GREEDY)[0].completion_tokens == 64
