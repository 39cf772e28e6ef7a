"""onnx-int4: MatMulNBits carries the layers' own codes and scales; ONNX Runtime matches the torch model."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from compress.exporters.dispatch import export
from compress.exporters.onnx_int4 import _reference, block_size, check, column_order, nbits_tensors
from compress.exporters.onnx_runner import OnnxCausalLM, greedy_generate
from compress.exporters.packing import unpack_nibbles
from compress.format.checkpoint import load_quantized, quantized_modules
from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight, Scheme, compute_qparams, quantize, quantize_weight


def _layer(k: int, n: int, scheme: Scheme, act_order: bool = False, seed: int = 0) -> QuantLinear:
    from .models import act_order_map

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if not act_order:
        return QuantLinear.from_quantized(quantize_weight(w, scheme))
    g_idx = act_order_map(k, scheme, gen)
    scale, zero = compute_qparams(w[:, torch.argsort(g_idx, stable=True)], scheme)
    return QuantLinear.from_quantized(QuantizedWeight(quantize(w, scale, zero, scheme, g_idx), scale, zero, scheme, g_idx))


def _run_single_node(m: QuantLinear, x: np.ndarray) -> np.ndarray:
    """One MatMulNBits node (plus the act-order Gather) built by hand from nbits_tensors, run on ORT CPU."""
    import onnxruntime as ort

    t = nbits_tensors(m)
    inits = [numpy_helper.from_array(t["b"].numpy(), "B"), numpy_helper.from_array(t["scales"].float().numpy(), "S")]
    ins, nodes, a = ["A2", "B", "S"], [], "A"
    if t["zero_points"] is not None:
        inits.append(numpy_helper.from_array(t["zero_points"].numpy(), "Z"))
        ins.append("Z")
    if t["perm"] is not None:
        inits.append(numpy_helper.from_array(t["perm"].numpy(), "P"))
        nodes.append(helper.make_node("Gather", ["A", "P"], ["A2"], axis=-1))
    else:
        ins[0] = "A"
    nodes.append(helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=m.in_features,
                                  N=m.out_features, bits=4, block_size=t["block"], accuracy_level=0))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [None, m.in_features])],
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [None, m.out_features])], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                   helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": x})[0]


LAYERS = [  # (K, N, scheme, act_order): block choice, ragged K, oversize groups, act-order
    (128, 32, Scheme(4, 32, sym=False), False),
    (80, 32, Scheme(4, 32, sym=False), False),  # ragged: 3 blocks of 32, the last one half empty
    (576, 16, Scheme(4, 128, sym=True), False),  # SmolLM2's width: 4.5 groups of 128
    (576, 16, Scheme(4, -1, sym=False), False),  # per channel: blocks of 256 repeating the row's scale
    (1024, 16, Scheme(4, 512, sym=False), False),  # groups over 256: blocks repeat each group's scale
    (128, 32, Scheme(4, 32, sym=False), True),
    (96, 32, Scheme(4, 32, sym=True), True),
]


@pytest.mark.parametrize("k,n,scheme,act_order", LAYERS)
def test_matmul_nbits_on_ort_equals_the_dequantized_linear(k, n, scheme, act_order):
    m = _layer(k, n, scheme, act_order)
    assert check(m) is None
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    ref = torch.nn.functional.linear(x.double(), m.dequantized_weight(torch.float64))
    got = torch.from_numpy(_run_single_node(m, x.numpy())).double()
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
    t = nbits_tensors(m)  # the eager custom op implements the same math
    eager = _reference(x, t["b"], t["scales"], t["zero_points"], t["perm"], k, n, 4, t["block"])
    torch.testing.assert_close(eager.double(), ref, rtol=1e-4, atol=1e-4)


def test_blocks_carry_the_codes_unchanged():
    m = _layer(80, 32, Scheme(4, 32), act_order=False)
    t = nbits_tensors(m)
    assert t["b"].shape == (32, 3, 16) and t["b"].dtype == torch.uint8 and t["block"] == 32
    codes = unpack_nibbles(t["b"]).reshape(32, -1)
    assert torch.equal(codes[:, :80], m.codes()) and not bool(codes[:, 80:].any())
    zp = unpack_nibbles(t["zero_points"].reshape(32, 2))[:, :3]
    assert torch.equal(zp, m.qzeros) and torch.equal(t["scales"].reshape(32, 3), m.scales)


@pytest.mark.parametrize("scheme,why", [(Scheme(8, 32), "4-bit"), (Scheme(4, 32, sym=True, format="nf4"), "nf4"),
                                        (Scheme(4, 24), "multiple of 16")])
def test_check_names_what_matmul_nbits_cannot_carry(scheme, why):
    assert why in check(_layer(96, 16, scheme))


def test_block_size_choice():
    assert block_size(_layer(576, 8, Scheme(4, 128))) == 128
    assert block_size(_layer(576, 8, Scheme(4, -1))) == 256
    assert block_size(_layer(64, 8, Scheme(4, -1))) == 64
    assert block_size(_layer(96, 8, Scheme(4, 48))) == 16


CASES = [  # whole decoders: (family, group, sym, act_order, hidden)
    ("llama", 32, False, False, 80),  # ragged last group
    ("qwen2", 32, True, True, 64),  # q/k/v biases, act-order
    ("mistral", -1, False, False, 64),
    ("gemma", 64, False, True, 64),
]


@pytest.mark.parametrize("family,group,sym,act_order,hidden", CASES)
def test_decoder_logits_and_greedy_match_the_quantized_torch_model(exported, family, group, sym, act_order, hidden):
    src, out = exported("onnx-int4", family=family, group=group, sym=sym, act_order=act_order, hidden=hidden)
    ours, ort_model = load_quantized(src), OnnxCausalLM(out)
    graph = onnx.load(str(out / "model.onnx"))
    qmods = quantized_modules(ours)
    nodes = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == len(qmods) and all(n.domain == "com.microsoft" for n in nodes)
    permuted = sum(column_order(m) is not None for m in qmods.values())
    assert permuted > 0 if act_order else permuted == 0
    assert sum(n.op_type == "Gather" for n in graph.graph.node) >= permuted
    inits = {i.name: i for i in graph.graph.initializer}
    name, m = next(iter(qmods.items()))
    b = torch.from_numpy(numpy_helper.to_array(inits[f"model.{name}.b"]).copy())
    assert torch.equal(b, nbits_tensors(m)["b"]), "B must hold the layer's own codes"
    assert not any(i.endswith(f"{name}.weight") for i in inits), "no fp copy of a quantized weight"
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ours(ids).logits
    got = ort_model(ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-3
    assert greedy_generate(ort_model, ids[:1], 16).tolist() == greedy_generate(ours, ids[:1], 16).tolist()


def test_refuses_three_bit_naming_gptq(quantized_dir, tmp_path):
    with pytest.raises(ValueError, match="onnx-int4 cannot carry") as e:
        export(str(quantized_dir(family="llama", bits=3)), "onnx-int4", tmp_path / "out")
    assert "gptq" in str(e.value) and not (tmp_path / "out").exists()


def test_compress_eval_measures_the_onnx_artifact_beside_torch(exported, tmp_path):
    """`compress eval ONNX_DIR --baseline QUANTIZED_DIR`: the same perplexity from ONNX Runtime as from torch."""
    from eval.report import evaluate

    src, out = exported("onnx-int4", family="llama", group=32, sym=False)
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"paragraph {i}: " + "some plain words to score " * 20 for i in range(12)))
    res = evaluate(str(out), baseline_spec=str(src), ppl_sources=[str(text)], seqlen=64, max_windows=4)
    ours, theirs = res.baseline.ppl[str(text)], res.compressed.ppl[str(text)]
    assert abs(theirs - ours) / ours < 1e-3
    assert res.compressed.size_bytes > 0
