"""Files stay small enough to read in one sitting (issue 37): no module over 400 lines and no function over 60 in
compress/, runtime/ and eval/; GPU kernels, whose bodies a Triton JIT needs in one piece, are named exceptions."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compress", "runtime", "eval")
KERNELS = {"runtime/kernels/triton_attention.py:_prefill_kernel"}


def _modules():
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_its_functions_are_small(path):
    src = path.read_text()
    assert src.count("\n") <= 400, f"{path.relative_to(ROOT)}: split it by role"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(src))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60
            and f"{path.relative_to(ROOT)}:{node.name}" not in KERNELS]
    assert not long, f"{path.relative_to(ROOT)}: {long}"
