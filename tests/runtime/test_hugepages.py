"""Packed weights moved into transparent huge pages (runtime/hugepages.py): the mode read from the kernel's file, the
same outputs from the moved buffers, all of them in one arena, and nothing moved where the kernel offers no huge
pages."""
import pytest
import torch

from compress.format.quant import Scheme
from runtime import hugepages
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.kernels import cpu_ext, w8a8
from runtime.sequence import SamplingParams
from test_qmatmul import random_qlinear
from tiny_engine import prompts, rtn4_folder, save_tiny

vnni = pytest.mark.skipif(not (cpu_ext.load() and w8a8.available()),
                          reason="the W8A8 kernels need AVX512-VNNI, which this CPU lacks")


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                       ("always madvise [never]\n", "never"), ("garbled\n", "")])
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert hugepages.thp_mode(f) == mode


def test_thp_mode_without_the_file_is_empty(tmp_path):
    assert hugepages.thp_mode(tmp_path / "missing") == ""


def test_arena_is_zeroed_writable_memory():
    a = hugepages.arena(3 << 20)
    assert a.dtype == torch.uint8 and a.numel() == 3 << 20 and int(a.sum()) == 0
    a[-1] = 7
    assert a[-1] == 7


def _model(n: int = 3) -> torch.nn.Sequential:
    schemes = [Scheme(bits=4, group_size=64, sym=False), Scheme(bits=8, group_size=-1, sym=True)]
    return torch.nn.Sequential(*[w8a8.W8A8Linear(random_qlinear(48 + 16 * i, 128, schemes[i % 2], seed=i))
                                 for i in range(n)])


@vnni
def test_moved_weights_give_the_same_outputs_from_one_arena():
    model = _model()
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    before = [m(x) for m in model]
    old = [[t.clone() for t in m.packed()] for m in model]
    moved = hugepages.move_weights(model, mode="madvise")
    assert moved == sum(t.numel() * t.element_size() for ts in old for t in ts)
    storages = {t.untyped_storage().data_ptr() for m in model for t in m.packed()}
    assert len(storages) == 1  # one arena
    for m, ts, y in zip(model, old, before):
        assert all(torch.equal(a, b) for a, b in zip(m.packed(), ts))
        assert m._args[:3] == m.packed()  # the op runs from the moved buffers
        assert torch.equal(m(x), y)
    addresses = sorted(t.data_ptr() for m in model for t in m.packed())
    assert all(a % hugepages.ALIGN == 0 for a in addresses)


@vnni
@pytest.mark.parametrize("mode", ["never", ""])
def test_nothing_moves_without_huge_pages(mode):
    model = _model(1)
    ptrs = [t.data_ptr() for t in model[0].packed()]
    assert hugepages.move_weights(model, mode=mode) == 0
    assert [t.data_ptr() for t in model[0].packed()] == ptrs


@vnni
def test_engine_tokens_equal_with_and_without_huge_pages(tmp_path):
    hf = save_tiny("llama", tmp_path / "fp")
    rtn4_folder(hf, tmp_path / "q")
    outs = []
    for huge in (True, False):
        engine = Engine(EngineConfig(model=str(tmp_path / "q"), dtype="bfloat16", kv_cache_memory=1 << 22,
                                     block_size=4, huge_pages=huge))
        outs.append([o.token_ids for o in engine.generate(prompts(256), SamplingParams(max_tokens=8,
                                                                                       ignore_eos=True))])
    assert outs[0] == outs[1]
