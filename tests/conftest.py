"""Process-wide test setup that must happen before anything imports Triton."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # Triton picks interpreter vs compiler once per process, when it is first imported (importing a
    # transformers model already does that). Without CUDA only the interpreter can run kernels, so the
    # Triton kernel tests (tests/runtime/test_triton_*.py) need it set from the very start.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # the models here are tiny: a thread pool costs more than it saves on them (tests of threaded kernels set
    # their own counts); COMPRESS_TEST_THREADS overrides
    torch.set_num_threads(int(os.environ.get("COMPRESS_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The real SmolLM2 tokenizer, read from the embedded GGUF (a few seconds, once per session)."""
    from compress.format.models import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m"))


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory):
    """A local .txt calibration source with enough tokens for tiny runs."""
    import torch

    words = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches "
             "and a gentle breeze carries the scent of rain across the distant valley").split()
    g = torch.Generator().manual_seed(0)
    paras = []
    for _ in range(60):
        idx = torch.randint(0, len(words), (80,), generator=g).tolist()
        paras.append(" ".join(words[i] for i in idx) + ".")
    path = tmp_path_factory.mktemp("data") / "calib.txt"
    path.write_text("\n\n".join(paras))
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_tokenizer):
    """A tiny random Llama saved with the SmolLM2 tokenizer: a real model folder for CLI tests."""
    from tiny_models import tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model("llama", vocab=len(smol_tokenizer)).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path
