"""docs/layout.md matches the tree: every compress module (per package) and every recipe is named, and nothing named
is gone."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _block() -> dict[str, str]:
    """The layout block's text per entry: top-level ones (``compress/``, ``recipes/``, ...) and the sub-entries
    indented under them (``  format/`` under ``compress/`` is ``compress/format/``)."""
    text = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    out, key, parents = {}, None, []  # parents: (indent, key) of the entries above the current line
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        m = re.match(r"(\S+/)\s", line.lstrip() + " ")
        if line and (indent == 0 or (indent < 8 and m)):
            parents = [(i, k) for i, k in parents if i < indent]
            key = (parents[-1][1] if parents else "") + line.split()[0]
            parents.append((indent, key))
            out[key] = line.strip()[len(line.split()[0]):]
        elif key:
            out[key] += " " + line
    return out


def test_every_entry_exists():
    assert [k for k in _block() if not (ROOT / k).exists()] == []


def test_every_compress_module_is_named_and_every_named_one_exists():
    """Per package of compress/ (exporters/ apart: its own docs), the modules named are the modules there."""
    block = _block()
    for key in [k for k in block if k.startswith("compress/")]:
        named = set(re.findall(r"\b(\w+\.py)\b", block[key]))
        have = {p.name for p in (ROOT / key).glob("*.py")} - {"__init__.py"}
        assert (key, sorted(have - named), sorted(named - have)) == (key, [], [])
    packages = {f"{p.parent.relative_to(ROOT)}/" for p in (ROOT / "compress").rglob("*.py")}
    assert sorted(packages - set(block) - {"compress/exporters/"}) == []


def test_the_recipes_listed_are_the_recipes_shipped():
    named = set(re.findall(r"[\w-]+", _block()["recipes/"]))
    assert named == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}


def test_compress_top_level_stays_small():
    """compress/ keeps the runner, streaming, memory planning and the API; the rest lives in format/, methods/,
    transforms/ and exporters/ (12 modules at most, __init__.py counted)."""
    assert len(list((ROOT / "compress").glob("*.py"))) <= 12
