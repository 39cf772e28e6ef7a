"""Write the family x step support matrix into README.md from compress/format/families.py (``--check``: exit 1 if
stale), with the published checkpoints whose configs the tests build tiny models from (tests/configs/<model_type>/).

    python scripts/support_matrix.py            # rewrite the table between the README's markers
    python scripts/support_matrix.py --check    # fail when the README's table is not what the family table says
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REAL_CONFIGS = ROOT / "tests" / "configs"  # <model_type>/<org>--<name>.json, read by tests/test_real_configs.py
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
YES, NO = "yes", "-"

COLUMNS = ("family", "rtn, gptq, nf4, int8", "awq", "rotate", "kv-heads (gqa)", "MoE experts",
           "compressed-tensors, gptq, awq", "onnx, onnx-int4", "gguf", "runtime", "real configs tested")


def real_configs(model_type: str) -> str:
    """The checkpoints (names without their org) whose configs tests/test_real_configs.py runs for the family."""
    names = sorted(p.stem.split("--", 1)[-1] for p in (REAL_CONFIGS / model_type).glob("*.json"))
    return ", ".join(names) if names else NO


def row(model_type: str) -> list[str]:
    """One family's cells, read from its entry in compress/format/families.py and the export formats' flags."""
    from compress.exporters.dispatch import FORMATS
    from compress.format.families import FAMILIES, supports

    fam = FAMILIES[model_type]

    def mark(ok: bool) -> str:
        return YES if ok else NO

    per_linear = fam.experts is None or all(FORMATS[f].experts for f in ("compressed-tensors", "gptq", "awq"))
    return [f"`{model_type}`", YES, mark(supports(model_type, "awq")), mark(supports(model_type, "rotate")),
            mark(supports(model_type, "gqa")), "packed" if fam.experts is not None else NO, mark(per_linear),
            mark(supports(model_type, "onnx")), f"`{fam.gguf.name}`" if fam.gguf is not None else NO,
            "native" if fam.runtime else "transformers", real_configs(model_type)]


def table() -> str:
    """The markdown table, one row per family of compress/format/families.py."""
    from compress.format.families import FAMILIES

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(t)) + " |" for t in FAMILIES]
    return "\n".join(lines)


def render(text: str) -> str:
    """``text`` with the table between the markers replaced by the current one."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"the README needs one {START} line followed by one {END} line")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's matrix is stale")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: compress is beside scripts/
    text = args.readme.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{args.readme}: the support matrix is stale; run python scripts/support_matrix.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
        print(f"updated the support matrix in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
