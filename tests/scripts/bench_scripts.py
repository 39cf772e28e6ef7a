"""Loads a script of scripts/bench/ as a module, for the tests of its pure helpers (the scripts are no package)."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"


def load_bench_script(name: str):
    """scripts/bench/<name>.py, executed once as module ``<name>_bench`` (registered in sys.modules, where
    dataclasses look their module's annotations up)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
