"""The runner's KV pool: zeros that cost resident memory only where written."""
import torch

from runtime.model_runner import zeros_on_demand


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_kv_pool_commits_memory_only_where_written():
    before = _rss_bytes()
    pool = zeros_on_demand((2, 4, 1024, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert pool.shape == (2, 4, 1024, 16, 8, 64) and pool.dtype == torch.bfloat16
    assert _rss_bytes() - before < 16 << 20  # reserved, not resident
    pool[0, 0, :64] = 1.0  # 64 blocks of one layer's K: 2 MiB
    assert 1 << 20 < _rss_bytes() - before < 24 << 20
    assert pool[0, 0, :64].eq(1).all() and not pool[1].any()  # zeros elsewhere, as torch.zeros


def test_8bit_pool_and_cuda_fallback_shapes():
    pool = zeros_on_demand((2, 3, 5), torch.uint8, torch.device("cpu"))
    assert pool.dtype == torch.uint8 and not pool.any()
    assert zeros_on_demand((0, 4), torch.float16, torch.device("cpu")).shape == (0, 4)
