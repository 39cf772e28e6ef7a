"""The README's family x step matrix is what compress/format/families.py says (scripts/support_matrix.py)."""
from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "support_matrix.py"


@pytest.fixture(scope="module")
def matrix():
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_the_readme_matrix_is_current(matrix):
    assert matrix.main(["--check"]) == 0, "run: python scripts/support_matrix.py"


def test_one_row_per_family_read_from_the_table(matrix):
    from compress.format.families import FAMILIES

    rows = matrix.table().splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == [f"`{t}`" for t in FAMILIES]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    assert cells["`llama`"][:9] == ["yes"] * 4 + ["-", "yes", "yes", "`llama`", "native"]
    assert "Llama-3.2-1B" in cells["`llama`"][9].split(", ")  # tests/configs/llama/meta-llama--Llama-3.2-1B.json
    assert cells["`mixtral`"][4:6] == ["packed", "-"]


def test_check_fails_on_a_stale_copy_and_the_write_mends_it(matrix, tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{matrix.START}\n| old |\n{matrix.END}\n\nmore\n")
    assert matrix.main(["--check", "--readme", str(readme)]) == 1
    assert "stale" in capsys.readouterr().err
    assert matrix.main(["--readme", str(readme)]) == 0
    assert matrix.main(["--check", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith(f"{matrix.END}\n\nmore\n") and "| old |" not in text
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="support-matrix:start"):
        matrix.main(["--readme", str(readme)])
