"""--offload-activations: calibration activations on disk change no result and leave no files behind."""
import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from compress import calibrate
from compress.config import load_recipe
from compress.format.shards import shard_files
from compress.job import quantize_to_folder
from compress.memory import plan, plan_offload
from compress.offload import DiskTensors
from tiny_models import tiny_model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in shard_files(Path(folder)):
        out.update(load_file(str(f)))
    return out


def test_disk_tensors_read_back_exactly_and_clean_up(tmp_path):
    ts = DiskTensors(tmp_path)
    batches = [torch.randn(2, 5, 8), torch.randn(2, 5, 8).to(torch.bfloat16)]
    for b in batches:
        ts.append(b)
    assert len(ts) == 2 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, batches))
    out = ts.sibling()
    out.append(ts[0] * 2)
    folders = [ts.folder, out.folder]
    del ts, out
    gc.collect()
    assert not any(f.exists() for f in folders)


@pytest.mark.parametrize("family,recipe,stream", [("llama", "gptq4", False), ("llama", "awq4", True),
                                                  ("qwen2_moe", "gptq4", True)])
def test_offloaded_equals_in_memory(tmp_path, smol_tokenizer, calib_text, family, recipe, stream, monkeypatch):
    src = tmp_path / family
    tiny_model(family, vocab=len(smol_tokenizer)).save_pretrained(src)
    smol_tokenizer.save_pretrained(src)
    cfg = load_recipe(recipe).replace(calib=str(calib_text), nsamples=4, seqlen=32, batch_size=2)
    seen = []
    run = calibrate.run_sequential

    def spy(model, batches, per_block, *a, **k):  # every block's inputs come from disk
        def observed(i, block, inputs):
            seen.append(isinstance(inputs.hidden, DiskTensors) and inputs.hidden.folder.is_dir())
            per_block(i, block, inputs)
        return run(model, batches, observed, *a, **k)

    for mod in ("gptq", "awq"):
        monkeypatch.setattr(f"compress.methods.{mod}.run_sequential", spy)
    on_disk = quantize_to_folder(str(src), cfg, str(tmp_path / "d"), stream=stream, offload_activations=True)
    assert seen and all(seen) and on_disk.memory["activations_offloaded"]
    held = quantize_to_folder(str(src), cfg, str(tmp_path / "m"), stream=stream, offload_activations=False)
    a, b = _tensors(on_disk.out), _tensors(held.out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d", "m", family])  # no activations folder left


def test_offload_is_chosen_when_only_it_fits():
    model = tiny_model("llama")
    cfg = load_recipe("gptq4").replace(nsamples=512, seqlen=512, batch_size=8)
    held, disk = plan(model, cfg, streamed=True), plan(model, cfg, streamed=True, offload=True)
    hidden = model.config.hidden_size  # on disk: every batch's inputs and outputs but the one being run
    assert held.activations - disk.activations >= 2 * (512 - 8) * 512 * hidden * 4
    between = (held.peak + disk.peak) // 2
    assert plan_offload(model, cfg, True, between, None) == (disk, True)
    assert plan_offload(model, cfg, True, held.peak, None) == (held, False)
    assert plan_offload(model, cfg, True, held.peak, True) == (disk, True)
    assert plan_offload(model, load_recipe("rtn4"), True, 1, None)[1] is False  # data-free: nothing to offload


def test_a_method_with_no_stored_activations_refuses_the_flag(tmp_path):
    with pytest.raises(ValueError, match="qat trains on token batches"):
        quantize_to_folder("unused", load_recipe("qat4"), str(tmp_path / "q"), offload_activations=True)
