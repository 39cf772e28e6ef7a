"""The block-by-block driver sees what the model's own forward does: each block gets the kwargs the model hands it
(Gemma 2/3's sliding and global layers take different attention masks, Gemma 3's different rotary tables)."""
import pytest
import torch

from compress.calibrate import capture_inputs, decoder_layers
from tiny_models import FAMILIES, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_chained_on_captured_inputs_reproduce_the_models_hidden_states(family):
    model = tiny_model(family).eval()
    batches = [torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    inputs = capture_inputs(model, batches)
    layers = decoder_layers(model)
    for i, block in enumerate(layers):
        inputs = inputs.next(inputs.forward(block), i + 1)
    with torch.no_grad():
        for ids, got in zip(batches, inputs.hidden):
            want = model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-1]
            # hidden_states[-1] is after the final norm in transformers' decoders: compare through it
            norm = model.get_submodule("model.norm")
            torch.testing.assert_close(norm(got), want, rtol=1e-4, atol=1e-4)


def test_capture_runs_no_block_and_restores_their_forward():
    model = tiny_model("gemma3_text").eval()
    layers = decoder_layers(model)
    calls = []
    handles = [m.register_forward_hook(lambda *a: calls.append(1)) for m in layers[0].modules()
               if isinstance(m, torch.nn.Linear)]
    inputs = capture_inputs(model, [torch.randint(3, 200, (1, 16))])
    assert calls == [] and all("forward" not in vars(layer) for layer in layers)
    assert len(inputs.layer_kwargs) == len(layers) and inputs.kwargs is inputs.layer_kwargs[0]
    for h in handles:
        h.remove()


def test_a_pass_announces_itself_before_its_first_block():
    """progress(0, n) before block 0 (after the capture), so a bar's clock and rate cover every block."""
    from compress.calibrate import run_blocks, run_sequential

    model = tiny_model("llama").eval()
    n = len(decoder_layers(model))
    for run, args in ((run_sequential, ([torch.randint(3, 200, (1, 8))],)), (run_blocks, ())):
        seen = []
        run(model, *args, lambda i, block, inputs: None, lambda *a: seen.append(a))
        assert seen == [(i, n) for i in range(n + 1)]
