"""The project's own modules import each other without cycles, and the house is layered by role: a static graph
over compress/ and runtime/ (eval/ too, for the arrows into it), every import statement counted, those inside
functions included, where a cycle or a wrong arrow would otherwise hide."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compress", "runtime")


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != name}


def graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = _modules(packages)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports():
    edges = graph()
    assert "compress.calibrate" in edges["compress.methods.common.moe"]  # imported inside expert_layout
    assert "compress.api" in edges["compress"]  # the lazy API lookup


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(graph()) == []


# -- the layers: format below everything, methods side by side, the runtime on format alone, eval on top ----------
def _in(name: str, pkg: str) -> bool:
    return name == pkg or name.startswith(pkg + ".")


def _is_method(name: str) -> bool:
    """A module directly in compress/methods/ (common/ holds what methods share and is not one)."""
    return name.startswith("compress.methods.") and name.count(".") == 2 and name != "compress.methods.common"


def _arrows(edges: dict[str, set[str]], source, target) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in edges.items() if source(a) for b in bs if target(b))


def test_format_imports_only_format():
    """What a checkpoint is depends on no method, transform, runner or exporter."""
    edges = graph()
    assert _arrows(edges, lambda a: _in(a, "compress.format"),
                   lambda b: _in(b, "compress") and not _in(b, "compress.format")) == []


def test_no_method_imports_another():
    """What two methods share lives in methods/common/ (or format/), and common/ imports no method."""
    edges = graph()
    assert _arrows(edges, _is_method, lambda b: _is_method(b)) == []
    assert _arrows(edges, lambda a: _in(a, "compress.methods.common"), _is_method) == []


def test_the_method_rule_sees_methods():
    assert _is_method("compress.methods.gptq") and not _is_method("compress.methods.common.gptq_solver")
    assert _arrows({"compress.methods.qat": {"compress.methods.awq"}}, _is_method, _is_method)


def _private_imports(importer, source: str) -> list[str]:
    """``from <source...> import _name`` statements in the modules ``importer`` accepts."""
    found = []
    for name, path in _modules().items():
        if importer(name):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and _in(node.module or "", source):
                    found += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_runtime_imports_only_format_and_nothing_private():
    """The runtime reads checkpoints through compress.format's public names and nothing else of compress."""
    edges = graph()
    assert _arrows(edges, lambda a: _in(a, "runtime"),
                   lambda b: _in(b, "compress") and not _in(b, "compress.format")) == []
    assert _private_imports(lambda a: _in(a, "runtime"), "compress") == []


def test_format_is_used_through_public_names():
    assert _private_imports(lambda a: not _in(a, "compress.format"), "compress.format") == []


def test_compress_imports_nothing_from_eval():
    """No import statement; and the one lookup by name, compress.api.evaluate's of eval.api (the Python API keeps
    ``compress.evaluate`` while the evaluation lives in eval/), is the only one."""
    edges = graph((*PACKAGES, "eval"))
    assert _arrows(edges, lambda a: _in(a, "compress"), lambda b: _in(b, "eval")) == []
    by_name = []
    for name, path in _modules().items():
        if _in(name, "compress"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                        "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                    by_name.append(f"{name}: {node.args[0].value}")
    assert by_name == ["compress.api: eval.api"]
