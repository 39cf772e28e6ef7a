"""The pure helpers of scripts/bench/kv_cache.py: prompts from held-out text, greedy agreement, admission count."""
import pytest

from bench_scripts import load_bench_script


@pytest.fixture(scope="module")
def kv():
    return load_bench_script("kv_cache")


def test_held_out_prompts_skip_short_paragraphs(kv):
    texts = ["too short", " ".join(f"w{i}" for i in range(30)), "", " ".join(f"v{i}" for i in range(24))]
    assert kv.held_out_prompts(texts, 5, words=24) == [" ".join(f"w{i}" for i in range(24)),
                                                        " ".join(f"v{i}" for i in range(24))]
    assert len(kv.held_out_prompts(texts, 1, words=24)) == 1


def test_greedy_agreement_counts_whole_and_prefix_matches(kv):
    ref = [list(range(20)), list(range(20)), list(range(20))]
    other = [list(range(20)), list(range(17)) + [0, 0, 0], [5] + list(range(1, 20))]
    g = kv.greedy_agreement(ref, other)
    assert g == {"equal": 1, "first16_equal": 2, "mean_common_prefix": (20 + 17 + 0) / 3}


def test_admitted_is_what_the_pool_holds(kv):
    assert kv.admitted(100, 16, 256, offered=50) == 6  # 16 blocks each
    assert kv.admitted(1000, 16, 256, offered=50) == 50  # everything offered fits
