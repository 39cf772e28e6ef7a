"""Process-wide test setup that must happen before anything imports Triton."""
import os


def pytest_configure(config):
    # Triton picks interpreter vs compiler once per process, when it is first imported (importing a
    # transformers model already does that). Without CUDA only the interpreter can run kernels, so the
    # Triton kernel tests (tests/runtime/test_triton_*.py) need it set from the very start.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
