import pytest

from eval.tradeoff.config import ReportConfig, parse_export, parse_size
from eval.tradeoff.pareto import Candidate, dominates, frontier, recommend

MiB = 2**20


def test_frontier_on_hand_made_points():
    pts = {"fp32": (540, 20.9), "int8": (170, 20.95), "nf4": (110, 23.9), "rtn4": (100, 26.9),
           "awq4": (100, 23.6), "gptq4": (100, 23.6), "bad": (200, 30.0), "rtn3": (80, 60.0)}
    # gptq4 ties awq4 exactly: neither dominates the other, both stay
    assert frontier(pts) == ["rtn3", "awq4", "gptq4", "int8", "fp32"]
    assert dominates((1, 1), (1, 2)) and not dominates((1, 2), (2, 1)) and not dominates((1, 1), (1, 1))


def test_frontier_in_three_objectives_keeps_a_fast_variant():
    pts = {"a": (100, 23.0, -50.0), "b": (100, 23.0, -90.0), "c": (90, 25.0, -10.0), "d": (120, 24.0, -40.0)}
    assert frontier(pts) == ["c", "b"]  # a and d lose to b on speed, c is the smallest


def rows():
    return [Candidate("fp32", 540 * MiB, 20.0, 40.0), Candidate("int8", 170 * MiB, 20.1, 90.0),
            Candidate("nf4", 110 * MiB, 20.9, 60.0), Candidate("awq4", 100 * MiB, 21.2, 120.0),
            Candidate("rtn4", 95 * MiB, 23.0, 125.0), Candidate("onnx", 98 * MiB, 21.1, None)]


def test_recommendations_on_hand_made_points():
    # 6% of 20.0 allows 21.2: onnx is the smallest within it, awq4 the fastest (onnx has no speed), and onnx
    # the most accurate of at most 105 MiB
    recs = recommend(rows(), rows()[0], max_ppl_increase=6.0, max_size=105 * MiB)
    assert [r.label for r in recs] == ["onnx", "awq4", "onnx"]
    # 4.6% allows 20.92: onnx (21.1) and awq4 (21.2) are out, so nf4 is the smallest within it
    recs = recommend(rows(), rows()[0], max_ppl_increase=4.6, max_size=105 * MiB)
    assert recs[0].label == "nf4" and "+4.5%" in recs[0].why
    assert recs[1].label == "int8" and "90.0 tok/s" in recs[1].why
    recs = recommend(rows(), rows()[0], max_ppl_increase=20.0, max_size=96 * MiB)
    assert [r.label for r in recs] == ["rtn4", "rtn4", "rtn4"]


def test_recommendations_when_nothing_qualifies():
    recs = recommend(rows(), Candidate("fp32", 540 * MiB, 10.0, 40.0), max_ppl_increase=1.0, max_size=1)
    assert [r.label for r in recs] == [None, None, None]
    assert "none" in recs[0].why and "none fits" in recs[2].why


def test_sizes_exports_and_config_validation():
    assert parse_size("120MB") == 120_000_000 and parse_size("100MiB") == 100 * MiB and parse_size("512") == 512
    assert parse_size("0.5 GiB") == 2**29
    with pytest.raises(ValueError, match="120MB"):
        parse_size("lots")
    assert parse_export("onnx-int4:rtn4") == ("onnx-int4", "rtn4")
    with pytest.raises(ValueError, match="FORMAT:RECIPE"):
        parse_export("safetensors:rtn4")
    with pytest.raises(ValueError, match="nothing to report"):
        ReportConfig(model="m", out="o", recipes=())
    with pytest.raises(ValueError, match="max-windows"):
        ReportConfig(model="m", out="o", max_windows=0)
    with pytest.raises(ValueError, match="max-ppl-increase"):
        ReportConfig(model="m", out="o", max_ppl_increase=-1)
