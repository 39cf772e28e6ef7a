"""A fault's one line names the model type from the model's own metadata, and where in the step it happened."""
import json

import pytest

from compress.errors import during, fault_line, model_type


def test_model_type_from_a_folder_a_gguf_and_nothing(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    w = GGUFWriter(str(tmp_path / "m.gguf"), "gemma2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert model_type(str(tmp_path / "hf")) == "qwen2"
    assert model_type(str(tmp_path / "m.gguf")) == "gemma2"
    assert model_type(str(tmp_path / "nothing")) == "unknown" and model_type(None) == "unknown"


def test_during_tags_faults_and_leaves_bad_input_alone():
    with pytest.raises(RuntimeError) as fault:
        with during("quantizing block 2 of 4"):
            raise RuntimeError("shape mismatch\nsecond line")
    assert fault_line("quantize", None, fault.value) == \
        "error: quantize failed while quantizing block 2 of 4: RuntimeError: shape mismatch"
    with pytest.raises(ValueError) as bad:
        with during("anything"):
            raise ValueError("bits=5 is not supported")
    assert not getattr(bad.value, "__notes__", None)
