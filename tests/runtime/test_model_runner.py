"""The runner's KV pool: zeros that cost resident memory only where written."""
import torch

from runtime.model_runner import zeros_on_demand


def _resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the memory mapping that holds ``t`` (/proc/self/smaps)."""
    addr, rss, inside = t.data_ptr(), None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                rss = int(line.split()[1]) * 1024
    assert rss is not None, "no mapping holds the tensor"
    return rss


def test_kv_pool_commits_memory_only_where_written():
    pool = zeros_on_demand((2, 4, 1024, 16, 8, 64), torch.bfloat16, torch.device("cpu"))  # 128 MiB
    assert pool.shape == (2, 4, 1024, 16, 8, 64) and pool.dtype == torch.bfloat16
    assert _resident_bytes(pool) == 0  # reserved, not resident
    pool[0, 0, :64] = 1.0  # 64 blocks of one layer's K: 64 x 16 x 8 x 64 x 2 bytes = 1 MiB
    assert _resident_bytes(pool) == 1 << 20
    assert pool[0, 0, :64].eq(1).all() and not pool[1].any()  # zeros elsewhere, as torch.zeros


def test_8bit_pool_and_empty_shapes():
    pool = zeros_on_demand((2, 3, 5), torch.uint8, torch.device("cpu"))
    assert pool.dtype == torch.uint8 and not pool.any()
    assert zeros_on_demand((0, 4), torch.float16, torch.device("cpu")).shape == (0, 4)
