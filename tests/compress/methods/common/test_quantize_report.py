"""The run's typed records and notes write the JSON the run wrote as dicts: the same keys, in the same order, unset
fields left out (`compress quantize --json`, the checkpoint's quantization_config)."""
import json

import pytest
from tiny_models import one_thread, tiny_model, token_batches

from compress.config import QuantizeConfig
from compress.methods.common.report import (ExpertRecord, FallbackNote, FitNote, GQANote, HeadNote, Judgement, KVHeads,
                                            LayerRecord, Notes, QATNote, QuantizeReport, RotateNote, SmoothRecord,
                                            UptrainNote)
from compress.pipeline import quantize_model

KEPT, FELL = Judgement(0.5, 0.6, "kept"), Judgement(0.7, 0.6, "rtn")
JUDGED = ["heldout_error", "rtn_heldout_error", "choice"]


@pytest.mark.parametrize("record, keys", [
    (LayerRecord(0, "q_proj", 0.1), ["layer", "name", "loss"]),  # gptq, awq's gptq rounding
    (LayerRecord(0, "q_proj", 0.1, KEPT, names=["m.0.q_proj"]), ["layer", "name", "loss", *JUDGED, "names"]),
    (LayerRecord(0, "o_proj", judged=FELL, clip=0.9, names=["m.0.o_proj"]),  # awq: a linear in no group
     ["layer", "name", *JUDGED, "clip", "names"]),
    (SmoothRecord(1, "input_layernorm", 0.5, 0.1, 0.2), ["layer", "smooth", "ratio", "loss", "rtn_loss"]),
    (SmoothRecord(1, "input_layernorm", 0.5, 0.1, 0.2, KEPT, 0.95, ["a", "b"]),
     ["layer", "smooth", "ratio", "loss", "rtn_loss", *JUDGED, "clip", "names"]),
    (ExpertRecord(0, 3, 40, False, {"gate_up_proj": 0.1, "down_proj": 0.2}),
     ["layer", "expert", "tokens", "fallback", "gate_up_proj", "down_proj"]),
    (ExpertRecord(0, 3, 0, True), ["layer", "expert", "tokens", "fallback"]),  # data-free: no losses
])
def test_records_write_the_old_keys_in_order(record, keys):
    out = json.loads(json.dumps(record.to_json()))
    assert list(out) == keys
    assert {k: out[k] for k in JUDGED if k in out} == ({} if record.judged is None else vars(record.judged))


def test_notes_write_the_steps_that_ran_in_the_order_they_run():
    notes = Notes()
    assert notes.to_json() == {} and notes.checkpoint() == {}
    notes.head_calibration = HeadNote("gptq", 0.01, KEPT, 2.0)
    notes.fallback = FallbackNote(1, 14, 1, {"m.0.q_proj": "rtn"})
    notes.gqa = GQANote(KVHeads(4, 2, 256, 128), uptrain=UptrainNote(0.3, 0.2, 1.0))
    notes.rotate = RotateNote("hadamard", 64, 16, False, 0)
    out = json.loads(json.dumps(notes.to_json()))
    assert list(out) == ["rotate", "gqa", "fallback", "head_calibration"]
    assert list(out["gqa"]) == ["kv_heads_before", "kv_heads_after", "kv_bytes_per_token_before",
                                "kv_bytes_per_token_after", "uptrain_loss_first", "uptrain_loss_last",
                                "uptrain_seconds"]  # no fit ran: its keys are left out
    assert out["head_calibration"] == {"method": "gptq", "gptq_loss": 0.01, **vars(KEPT), "seconds": 2.0}
    assert list(HeadNote("gptq", 0.01).to_json()) == ["method", "gptq_loss", "seconds"]  # nothing held out
    assert out["fallback"] == {"heldout_windows": 1, "judged": 14, "rtn": 1, "layers": {"m.0.q_proj": "rtn"}}
    assert list(notes.checkpoint()) == ["fallback", "head_calibration"]


def test_note_lines():
    assert GQANote(KVHeads(4, 2, 256, 128)).line() == "kv heads: 4 -> 2, KV cache 256 -> 128 bytes/token (fp16)"
    assert GQANote(KVHeads(4, 2, 2560, 1280), FitNote(0.5, 0.25, 3.0), UptrainNote(0.3, 0.2, 1.0)).line() == (
        "kv heads: 4 -> 2, KV cache 2,560 -> 1,280 bytes/token (fp16), attention fit error 0.500 -> 0.250, "
        "uptraining KL 0.3000 -> 0.2000")
    assert QATNote("awq", 14, 20, 0.5, 0.25, 30.0, 0.0).line() == "qat: 20 steps from awq, KL 0.5000 -> 0.2500 in 30 s"
    assert FallbackNote(1, 14, 3, {}).line().startswith("fallback: 3 of 14 layers kept RTN, better on 1 held-out")


def test_a_report_round_trips_through_json_and_its_decisions_name_full_linears():
    report = QuantizeReport("awq", 1.5, [SmoothRecord(0, "input_layernorm", 0.5, 0.1, 0.2, FELL, 1.0, ["a", "b"]),
                                         LayerRecord(0, "o_proj", 0.3), ExpertRecord(0, 0, 9, False)])
    out = json.loads(json.dumps(report.to_json()))
    assert list(out) == ["method", "seconds", "layers", "notes"] and out["notes"] == {}
    assert [list(r)[1] for r in out["layers"]] == ["smooth", "name", "expert"]
    assert report.decisions() == {"a": "rtn", "b": "rtn"}


def test_a_gptq_run_reports_typed_records_with_the_old_json():
    with one_thread():
        report = quantize_model(tiny_model("llama", layers=1), QuantizeConfig(method="gptq", group_size=32),
                                token_batches(8))
    assert all(isinstance(r, LayerRecord) and r.judged is not None for r in report.layers) and len(report.layers) == 7
    out = json.loads(json.dumps(report.to_json()))
    assert list(out["layers"][0]) == ["layer", "name", "loss", *JUDGED, "names"]
    assert out["notes"]["fallback"]["judged"] == 7 and report.notes.fallback.judged == 7
