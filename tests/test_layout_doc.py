"""docs/layout.md matches the tree: every compress module and every recipe is named, and nothing named is gone."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _block() -> dict[str, str]:
    """The layout block's text per top-level entry (``compress/``, ``recipes/``, ...)."""
    text = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
    out, key = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            key = line.split()[0]
            out[key] = line[len(key):]
        elif key:
            out[key] += " " + line
    return out


def test_every_entry_exists():
    assert [k for k in _block() if not (ROOT / k).exists()] == []


def test_every_compress_module_is_named_and_every_named_one_exists():
    named = set(re.findall(r"\b(\w+\.py)\b", _block()["compress/"]))
    have = {p.name for p in (ROOT / "compress").glob("*.py")} - {"__init__.py"}
    assert sorted(have - named) == [] and sorted(named - have) == []


def test_the_recipes_listed_are_the_recipes_shipped():
    named = set(re.findall(r"[\w-]+", _block()["recipes/"]))
    assert named == {p.stem for p in (ROOT / "recipes").glob("*.yaml")}
