"""The sampler (compress/methods/common/sampler.py): the module inputs AWQ judges a scale on are the first whole
sequences holding the asked tokens, with the module's batch-shaped keyword arguments cut alike."""
from __future__ import annotations

import torch
from tiny_models import tiny_model

from compress.calibrate import capture_inputs, decoder_layers
from compress.methods.common.sampler import Sampler, first_rows


def test_first_rows_cuts_what_has_the_batch_dimension_only():
    mask, table = torch.zeros(4, 1, 6, 6), torch.ones(1, 6, 8)
    cut = first_rows((mask, table), 2, 4)
    assert cut[0].shape == (2, 1, 6, 6) and cut[1] is table  # a table shared by the batch stays whole
    assert first_rows(torch.arange(4), 2, 4).shape == (4,)  # 1-D (positions of one sequence) is not a batch
    assert first_rows(None, 2, 4) is None and first_rows(mask, 4, 4) is mask


def test_module_inputs_hold_the_first_sequences_and_reproduce_their_outputs():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(0, 200, (2, 4, 16), generator=torch.Generator().manual_seed(0))  # 2 batches of 4 x 16
    inputs = capture_inputs(model, list(ids))
    block = decoder_layers(model)[0]
    attn = block.self_attn
    outs = []
    handle = attn.register_forward_hook(lambda m, a, out: outs.append(out[0]))
    sampler = Sampler(inputs, 40, seed=0)  # 40 tokens: the first 3 sequences of the first batch (48 tokens)
    hook = attn.register_forward_pre_hook(sampler.module_hook("self_attn"), with_kwargs=True)
    with torch.no_grad():
        inputs.forward(block)
    hook.remove(), handle.remove()
    (hidden, kwargs), = sampler.module_inputs["self_attn"]
    assert hidden.shape[:2] == (3, 16)
    with torch.no_grad():
        again = attn(hidden, **kwargs)[0]
    torch.testing.assert_close(again, outs[0][:3].float())


def test_module_inputs_run_on_into_the_next_batch():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(0, 200, (3, 2, 16), generator=torch.Generator().manual_seed(1))  # 3 batches of 2 x 16
    inputs = capture_inputs(model, list(ids))
    block = decoder_layers(model)[0]
    sampler = Sampler(inputs, 48, seed=0)
    hook = block.mlp.register_forward_pre_hook(sampler.module_hook("mlp"), with_kwargs=True)
    with torch.no_grad():
        inputs.forward(block)
    hook.remove()
    assert [h.shape[0] for h, _ in sampler.module_inputs["mlp"]] == [2, 1]  # 32 + 16 tokens
