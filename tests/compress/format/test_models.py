import pytest
import torch
from tiny_models import tiny_model

from compress.format.models import load_model, resolve


def test_embedded_default_resolves_to_the_packaged_gguf():
    src = resolve("smollm2-135m")
    assert src.gguf_file and (src.path / src.gguf_file).is_file() and not src.quantized


def test_unknown_model_names_the_choices():
    with pytest.raises(FileNotFoundError, match="smollm2-135m"):
        resolve("no-such-model")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve(str(tmp_path))


@pytest.fixture
def saved(tmp_path, smol_tokenizer):
    def save(safe: bool):
        path = tmp_path / ("safe" if safe else "pickled")
        model = tiny_model("llama", vocab=len(smol_tokenizer))
        model.save_pretrained(path)
        smol_tokenizer.save_pretrained(path)
        if not safe:  # the legacy pickled layout: pytorch_model.bin only
            (path / "model.safetensors").unlink()
            torch.save(model.state_dict(), path / "pytorch_model.bin")
        return path
    return save


def test_safetensors_folder_loads(saved):
    model, tok, src = load_model(str(saved(True)))
    assert src.name == "safe" and not src.quantized
    assert model.config.model_type == "llama" and not model.training


def test_pickled_weights_need_an_explicit_flag(saved):
    path = saved(False)
    with pytest.raises(ValueError, match="--allow-pickle"):
        load_model(str(path))
    model, _, _ = load_model(str(path), allow_pickle=True)
    assert isinstance(model, torch.nn.Module)
