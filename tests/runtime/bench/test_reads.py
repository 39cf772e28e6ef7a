"""runtime/bench/reads.py: the weight bytes one step reads, traced: whole weights once each, gathered rows as rows,
untouched copies and excluded caches not at all; on an engine, exactly the decode kernels' buffers and the norms."""
import torch
from torch import nn

from runtime.bench.reads import StepReads, held_storages, trace_reads


class Toy(nn.Module):
    """A table gathered from, a linear read twice, a plain-attribute tensor, a copy never used, a cache to exclude."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(1000, 16)  # 64,000 bytes; one row is 64
        self.lin = nn.Linear(16, 16, bias=False)  # 1,024 bytes
        self.extra = torch.randn(16)  # a plain attribute, as kernels keep their arguments: 64 bytes
        self.args = (self.lin.weight,)  # the same storage again through a tuple: counted once
        self.register_buffer("copy", torch.randn(4096))  # never touched
        self.register_buffer("cache", torch.zeros(256, 16))  # the KV pool's stand-in
        self.register_buffer("rope", torch.randn(100, 16))  # sliced: only the view's bytes

    def forward(self, ids):
        x = self.table(ids)  # [1, 16]
        x = self.lin(x) * self.extra + self.rope[3:4]
        self.cache[0].copy_(x[0])
        return nn.functional.linear(x, self.args[0]) + self.cache[:2].sum(0)


def test_trace_counts_each_weight_once_and_gathers_as_rows():
    m = Toy()
    with torch.inference_mode():
        r = trace_reads(m, lambda: m(torch.tensor([7])), exclude=[m.cache])
    assert r.full == 1024 + 64 + 64  # lin once (two ops, one storage), extra, one rope row (a view of it)
    assert r.gathered == 64  # one embedding row, not the 64,000-byte table
    assert r.tensors == 4 and r.total == r.full + r.gathered
    assert isinstance(r, StepReads)


def test_weights_sharing_one_storage_count_each_span_once():
    """Weights laid out in one arena (runtime/hugepages.py): each read span counts, overlapping reads once."""
    arena = torch.randn(1000)
    a, b = arena[:256].view(16, 16), arena[512:768].view(16, 16)
    with torch.inference_mode():
        r = trace_reads(nn.Module(), lambda: None)
        assert r.full == 0
        holder = nn.Module()
        holder.args = (a, b, arena[:128])
        x = torch.randn(1, 16)
        r = trace_reads(holder, lambda: (x @ a, x @ b, x @ a.T, arena[:128].sum()))
    assert r.full == 2 * 256 * 4  # a (twice, and its first half again) and b; not the 1000-value arena
    assert r.tensors == 1


def test_held_storages_sees_attributes_and_drops_exclusions():
    m = Toy()
    held = held_storages(m, exclude=[m.cache])
    assert m.cache.untyped_storage().data_ptr() not in held
    assert held[m.extra.untyped_storage().data_ptr()] == 64
    assert held[m.lin.weight.untyped_storage().data_ptr()] == 1024
    assert len(held) == 5  # table, lin, extra, copy, rope


def test_engine_decode_step_reads_the_kernel_buffers_and_norms(tmp_path, smol_tokenizer):
    """rtn4 (tied int8 table): one decode step reads every linear's kernel buffers, the head (the whole table, as
    tiles) and the norms, plus a few gathered rows; not the KV pool, not the table a second time."""
    from compress.config import load_recipe
    from compress.job import quantize_to_folder
    from runtime.bench.reads import decode_step_reads
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.kernels import w8a8
    from runtime.sequence import SamplingParams
    from tiny_engine import save_tiny

    save_tiny("gemma", tmp_path / "fp", smol_tokenizer)  # tied embeddings
    out = quantize_to_folder(str(tmp_path / "fp"), load_recipe("rtn4"), str(tmp_path / "q")).out
    engine = Engine(EngineConfig(model=str(out), dtype="bfloat16", kv_cache_memory=1 << 22))
    r = decode_step_reads(engine, SamplingParams, [5, 6, 7, 8])
    model = engine.runner.model
    norms = sum(p.nbytes for n, p in model.named_parameters() if n.endswith("norm.weight"))
    assert not engine.has_unfinished() and r.full >= norms
    if not w8a8.available():
        return  # the kernel layout below needs the VNNI kernels
    kernels = [m for m in model.modules() if isinstance(m, w8a8.W8A8Linear)]
    want = sum(k.weight.nbytes + k.scale.nbytes + k.szero.nbytes for k in kernels) + norms
    assert r.full == want, (r.full, want)
    table_bytes = model.lm_head.weight.nbytes
    assert 0 < r.gathered < table_bytes // 100  # an embedding row's scales, rotary rows: no second table
